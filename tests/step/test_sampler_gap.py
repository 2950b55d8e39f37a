"""The per-step proof on the path that samples: every step's sampler log-probs against the learner's, held to a
bound the conformance gate calibrates from this run's honest gap (objectives/ratios.py, step_bound; the learner's
_check_sampler_gap). A replica whose generation kept an older policy while its buffers, digest and probe are current
is stopped; an honest one never is; LoRA dropout does not enter the gap."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from miniverl.batches import PromptBatch
from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.pg_k1 import PgK1Objective
from miniverl.objectives.ratios import (
    STEP_MEAN_FLOOR,
    STEP_MEAN_MULTIPLE,
    STEP_SPREAD_Z,
    STEP_TAIL_FLOOR,
    STEP_TAIL_MULTIPLE,
    STEP_TAIL_SHARE,
)
from miniverl.objectives.sampler_check import (
    UNARMED_WARN_STEPS,
    VERSION_TEST_MIN_ROWS,
    VERSION_TEST_ROWS,
    VERSION_TEST_TOKENS,
    SamplerGapError,
    VersionTestWatch,
    judge_step,
    version_test_rows,
    version_votes,
    vote_sums,
    vote_z,
)
from miniverl.rollout.sampling import SamplingParams
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from tests.step.faults import StaleSamplingWorker
from tests.step.test_controller import CPU, LORA, PARAMS
from tests.step.test_sync import build, gate

GKD = GkdObjective(0.5, 1.0, 0)


def sixteen_prompts(tok) -> PromptBatch:
    """Sixteen reversal prompts: with PARAMS' two samples each, 32 rows, enough for the version test to vote."""
    words = ["abc", "de", "fgh", "ij", "klm", "no", "pqr", "st", "uvw", "xy", "za", "bcd", "ef", "ghi", "jk", "lmn"]
    return PromptBatch([tok(f"{w}>")["input_ids"] for w in words], words, [w[::-1] for w in words])


def test_the_bound_is_a_multiple_of_the_gates_gap_never_looser_than_the_objective():
    tol = GKD.sampler_tolerance
    generic = tol.step_bound()
    assert (generic.mean_at(10), generic.tail, generic.source) == (tol.mean_gap, tol.p99_gap, "objective")
    bf16 = tol.step_bound(0.01, 0.05, 0.02)
    assert bf16.mean_at(10**8) == pytest.approx(STEP_MEAN_MULTIPLE * 0.01, rel=1e-3)  # a large step: the multiple
    small = STEP_MEAN_MULTIPLE * 0.01 + STEP_SPREAD_Z * 0.05 / 4  # a step of 16 tokens: + the p99's spread
    assert bf16.mean_at(16) == pytest.approx(small)
    assert tol.step_bound(0.01, 0.01, 0.02).mean_at(16) == pytest.approx(0.03 + STEP_SPREAD_Z * 0.02 / 4)  # or std's
    assert bf16.tail == pytest.approx(STEP_TAIL_MULTIPLE * 0.05) and bf16.source == "gate"
    assert bf16.tail_share_at(10**10) == pytest.approx(STEP_TAIL_SHARE, rel=1e-3)
    assert bf16.tail_share_at(16) > bf16.tail_share_at(10**10)
    fp32 = tol.step_bound(4e-7, 3e-6, 1e-7)  # rounding alone: the floors
    assert fp32.mean_at(10**6) == pytest.approx(STEP_MEAN_FLOOR, rel=1e-3) and fp32.tail == STEP_TAIL_FLOOR
    loose = tol.step_bound(0.4, 1.0, 0.5)  # a gate that passed near the objective's bound: the objective's stays
    assert (loose.mean_at(4), loose.tail) == (tol.mean_gap, tol.p99_gap)
    tis = PgK1Objective(0.0, 2.0, 0.0, "k1", 0.0).sampler_tolerance  # vLLM bf16 passed with TIS (mean 0.08, p99 0.28)
    vllm = tis.step_bound(0.08, 0.28)
    assert vllm.mean_at(10**10) == pytest.approx(0.24, rel=1e-3)
    assert vllm.tail == pytest.approx(math.log(2.0))  # beyond it: ratios TIS truncates


def test_a_row_votes_for_the_policy_its_sampler_log_probs_sit_nearer():
    learner, older = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]]), torch.tensor([[-1.5, -1.0], [-1.5, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert (version_votes(learner + 0.01, learner, older, mask) < -0.99).all()  # at the batch's version: against
    assert (version_votes(older - 0.01, learner, older, mask) > 0.99).all()  # at the older policy: for
    assert version_votes(learner, learner, learner, mask).abs().max() == 0  # policies that do not differ: no vote
    a, b = 0.25**2, 0.75**2  # row 1: its one token 0.25 from the learner's, 0.75 from the older policy's
    assert version_votes(learner + 0.25, learner, older, mask)[1] == pytest.approx((a - b) / (a + b))


def test_the_version_test_takes_rows_spread_over_the_batch_enough_for_its_tokens():
    assert version_test_rows([5] * 4) == [0, 1, 2, 3] and version_test_rows([]) == []  # a small batch: every row
    short = version_test_rows([6] * 256)  # rows of a few tokens: the most rows
    assert len(short) == VERSION_TEST_ROWS and short[:3] == [0, 8, 16]
    long = version_test_rows([512] * 256)  # the 4080 recipe's rows: the fewest that hold the tokens
    assert len(long) == VERSION_TEST_MIN_ROWS and 512 * len(long) >= VERSION_TEST_TOKENS


def test_the_votes_z_is_their_mean_over_its_standard_error_over_rows_and_sums_add_across_ranks():
    votes = torch.tensor([0.5, 1.0, -0.5, 1.0])
    mean, sd = 0.5, float(votes.std())
    assert vote_z(vote_sums(votes, 40)) == pytest.approx((mean, mean / (sd / 2)))
    halves = [vote_sums(votes[:2], 10), vote_sums(votes[2:], 30)]  # two ranks' rows
    assert [a + b for a, b in zip(*halves, strict=True)] == pytest.approx(vote_sums(votes, 40))
    assert vote_z(vote_sums(torch.ones(20), 20)) == (1.0, math.inf)  # every row at the older policy
    assert vote_z(vote_sums(torch.zeros(20), 20)) == (0.0, 0.0) and vote_z(vote_sums(votes[:1], 3)) == (0.0, 0.0)


def test_a_sampler_at_the_older_policy_votes_the_mirror_image_of_an_honest_one():
    """The same rounding e in the sampler's log-probs, at the batch's version (honest) or at the older policy: every
    row's vote flips sign, so an honest step's z tells how far a stale sampler's would have sat on the refused side."""
    gen = torch.Generator().manual_seed(0)
    learner = -torch.rand(16, 12, generator=gen) * 3
    older = learner + 0.02 * torch.randn(16, 12, generator=gen)  # a policy that moved a little
    rounding = 0.01 * torch.randn(16, 12, generator=gen)
    mask = torch.ones(16, 12)
    honest = version_votes(learner + rounding, learner, older, mask)
    stale = version_votes(older - rounding, learner, older, mask)
    assert torch.allclose(stale, -honest, atol=1e-12)
    z_honest, z_stale = vote_z(vote_sums(honest, 192))[1], vote_z(vote_sums(stale, 192))[1]
    assert z_stale == pytest.approx(-z_honest) and z_honest < -STEP_SPREAD_Z  # armed: the stale one is refused


def judged(votes: torch.Tensor) -> dict[str, float]:
    """judge_step's version metrics for one set of row votes used for both comparisons, the |gap| bound wide."""
    sums = vote_sums(votes, 10 * votes.numel()) * 2
    return judge_step(GKD.sampler_tolerance.step_bound(), 0.0, 0.0, 0, sums, 10 * votes.numel(), 3, 3)


def test_a_comparison_is_armed_where_its_honest_votes_sit_beyond_the_refusal_on_the_other_side():
    gen = torch.Generator().manual_seed(1)
    clear = -0.9 + 0.05 * torch.randn(VERSION_TEST_MIN_ROWS, generator=gen)  # policies apart: votes near -1
    assert judged(clear)["sampler_vs_previous_armed"] == judged(clear)["sampler_vs_base_armed"] == 1.0
    blurred = 0.3 * torch.randn(VERSION_TEST_MIN_ROWS, generator=gen)  # within the rounding: votes around 0
    assert vote_z(vote_sums(blurred, 1))[1] > -STEP_SPREAD_Z
    assert judged(blurred)["sampler_vs_previous_armed"] == 0.0
    few = clear[: VERSION_TEST_MIN_ROWS - 1]  # too few rows to vote: neither refused nor armed
    assert judged(few)["sampler_vs_previous_z"] < -STEP_SPREAD_Z and judged(few)["sampler_vs_previous_armed"] == 0.0
    with pytest.raises(SamplerGapError, match="sit nearer the learner's v2 than the v3"):
        judged(-clear)  # the mirror image: refused


def test_a_run_says_once_when_its_version_test_cannot_see_one_refresh_back_and_counts_what_it_saw():
    watch = VersionTestWatch()

    def step(prev: float, base: float, tokens: int = 4096) -> dict[str, float]:
        return {
            "sampler_version_tokens": tokens,
            "sampler_vs_previous_z": -1.5,
            "sampler_vs_previous_armed": prev,
            "sampler_vs_base_armed": base,
        }

    assert watch.observe(1, {"sampler_version_tokens": 0}) is None  # v0's batch: not voted, not counted
    assert watch.observe(2, {}) is None  # a step without the learner's check
    lines = [watch.observe(3 + i, step(0.0, float(i % 2))) for i in range(UNARMED_WARN_STEPS - 1)]
    assert lines == [None] * (UNARMED_WARN_STEPS - 1)
    assert watch.observe(50, step(1.0, 1.0)) is None  # armed once: the run of unarmed steps starts again
    lines = [watch.observe(60 + i, step(0.0, 1.0)) for i in range(2 * UNARMED_WARN_STEPS)]
    warned = [line for line in lines if line is not None]
    assert len(warned) == 1 and lines[UNARMED_WARN_STEPS - 1] is warned[0]  # once, at the 20th in a row
    assert f"step {60 + UNARMED_WARN_STEPS - 1}: for {UNARMED_WARN_STEPS} voted steps in a row" in warned[0]
    assert "a sampler one refresh behind would pass this test" in warned[0] and "over 4096 tokens" in warned[0]
    voted = 3 * UNARMED_WARN_STEPS
    base = (UNARMED_WARN_STEPS - 1) // 2 + 1 + 2 * UNARMED_WARN_STEPS
    assert f"armed on {base - UNARMED_WARN_STEPS} of {voted - UNARMED_WARN_STEPS} voted steps" in warned[0]
    assert watch.summary() == {"voted_steps": voted, "armed_steps": {"previous": 1, "base": base}}


def test_the_gate_calibrates_the_bound_every_step_is_held_to(parts, student_dir):
    ctl, learner = build(parts, student_dir, RolloutWorker, "hf_cached", "float32", 2e-3)
    lines = []
    out = gate(ctl, parts[1], "hf_cached", lines)
    assert (
        out["step_bound"] == dataclasses.asdict(learner.sampler_gap.bound)
        and learner.sampler_gap.bound.source == "gate"
    )
    assert learner.sampler_gap.bound.mean == STEP_MEAN_FLOOR  # fp32: the honest gap is rounding
    assert any("every step's sampler gap is held to mean 1.00e-04 nats (+ " in line for line in lines)  # after the gate
    metrics = ctl.step(parts[1], PARAMS)
    assert metrics["sampler_gap_mean"] < 1e-5 and metrics["sampler_gap_tail_frac"] == 0.0
    assert 0 <= metrics["sampler_gap_p99"] <= metrics["sampler_gap_max"]
    assert metrics["sampler_vs_previous_z"] == metrics["sampler_vs_base_z"] == 0.0  # v0's batch: nothing older


@pytest.mark.parametrize("backend", ["hf_reference", "hf_cached"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_replica_whose_generation_kept_an_older_policy_is_stopped(parts, student_dir, backend, dtype):
    """Its digest and probe are current (they read the buffers it loaded); only its samples come from v0. Main
    trained on them with the objective's 0.5-nat bound (issue 33: 20 of 20 steps at lr 2e-4). At lr 2e-2 one step
    moves these tiny models (steps of ~20 tokens) beyond bf16's honest gap; at smaller steps the fault is stopped
    once its accumulated drift is (lab/measurements/sampler_gap_faults.py: the step each learning rate is caught
    at)."""
    ctl, learner = build(parts, student_dir, StaleSamplingWorker, backend, dtype, 2e-2, probe_every=1)
    gate(ctl, parts[1], backend)
    ctl.step(parts[1], PARAMS)  # v0 samples v0: honest
    with pytest.raises(SamplerGapError, match=r"calibrated at the conformance gate .* generation path that kept"):
        ctl.step(parts[1], PARAMS)  # v1 loaded, digested and probed; v0 sampled
    assert learner.version == 1  # not one update on stale samples


def test_a_step_whose_tail_lies_beyond_the_bound_is_refused(parts, student_dir):
    """Tokens from somewhere else, each a little beyond the tail, inside a wide mean bound: the tail share refuses."""
    _, prompts, _, scorer = parts
    learner = LearnerWorker(str(student_dir), LORA, "float32", GKD, 1e-3, 0.0, 1.0, 2, CPU)
    learner.calibrate_sampler_gap(1e-3, 1e-2, 0.1)  # tail 0.04; a mean of 0.003 + 0.6 / sqrt(tokens)
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    rollout.load_policy(learner.publish_policy())
    batch = rollout.generate(prompts, PARAMS)
    tokens = int(batch.response_mask.sum())
    batch.rollout_log_probs -= 0.05 * batch.response_mask  # every token 0.05 off: beyond the tail
    assert learner.sampler_gap.bound.mean_at(tokens) > 0.05
    with pytest.raises(SamplerGapError, match=r"100\.0% of tokens beyond 0\.04\) .* of tokens beyond 0\.04\); the"):
        learner.update(batch, scorer.score(batch, 0, 1.0), None)
    assert learner.version == 0


@pytest.mark.parametrize("sampled_by", [1, 0])
def test_a_sampler_one_or_more_versions_behind_is_stopped_by_the_version_test(parts, student_dir, sampled_by):
    """The per-step |gap| bound held wide (a gate of bf16-sized numbers), fp32: only the version test can refuse. A
    batch stamped v2 but sampled by v1 (one refresh behind) or v0 (the base model) sits nearer the older policy;
    the same batch sampled by v2 passes with both votes below 0."""
    tok, _, _, scorer = parts
    prompts = sixteen_prompts(tok)
    learner = LearnerWorker(str(student_dir), LORA, "float32", GKD, 2e-2, 0.0, 1.0, 2, CPU)
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    snapshots = []
    for _ in range(2):  # v0 and v1 sampled and trained on honestly
        snapshots.append(learner.publish_policy())
        rollout.load_policy(snapshots[-1])
        batch = rollout.generate(prompts, PARAMS)
        learner.update(batch, scorer.score(batch, 0, 1.0), None)
    assert len(batch) >= VERSION_TEST_MIN_ROWS
    current = learner.publish_policy()
    learner.calibrate_sampler_gap(0.15, 0.5, 0.0)  # |gap| may reach 0.45 nats a step: wide
    rollout.load_policy(snapshots[sampled_by])
    stale = dataclasses.replace(rollout.generate(prompts, PARAMS), policy_version=2)
    older = "v1" if sampled_by == 1 else "(v1|base model .*)"
    with pytest.raises(SamplerGapError, match=rf"sit nearer the learner's {older} than the v2 the batch is stamped"):
        learner.update(stale, scorer.score(stale, 0, 1.0), None)
    assert learner.version == 2
    rollout.load_policy(current)
    batch = rollout.generate(prompts, PARAMS)
    metrics = learner.update(batch, scorer.score(batch, 0, 1.0), None)
    assert metrics["sampler_vs_previous_z"] < 0 and metrics["sampler_vs_base_z"] < 0, metrics
    assert metrics["sampler_version_tokens"] == int(batch.response_mask.sum())  # <= 32 rows: every row


class JitteryStaleWorker(RolloutWorker):
    """Loads the gate's trial adapter and v0, then keeps v0 while acknowledging every later snapshot; reports no
    served digest, and its probe log-probs move by 2e-3 nats from one refresh to the next (vLLM's probes move with
    batch make-up) although the two probes its noise floor is measured on agree: the probe's change test sees a
    served probe that moved, so only what the replica samples can show it is stale."""

    calls = 0

    def load_policy(self, snapshot):
        if snapshot.identity.version <= 0:
            return super().load_policy(snapshot)
        self.served = snapshot.identity
        return self.served

    def probe_logprobs(self, sequences):
        self.calls += 1  # the gate's two probes agree (its noise floor 0); every later one sits 1e-3 off the last
        shift = 0.0 if self.calls <= 2 else 1e-3 * (-1) ** self.calls
        return [[x + shift for x in row] for row in super().probe_logprobs(sequences)]


@pytest.mark.parametrize(("lr", "by_step"), [(2e-3, 1), (2e-4, 1), (2e-5, 3)])
def test_a_digest_less_replica_that_kept_its_weights_is_stopped_where_the_probe_cannot_tell(
    parts, student_dir, lr, by_step
):
    """Issue 33 (4): such a replica trained 14 of 14 stale bf16 steps at lr 2e-5 and 2e-4. Its samples come from v0
    while the batches are stamped v1, v2, ...: the version test stops it at the first stale step at lr 2e-3 and 2e-4
    (32 rows of a few tokens), by the third at 2e-5, before that step's update (with transformers 5.25 the per-step
    |gap| bound, whose floor the gate set here, stops it at the second; 5.24's arithmetic left it to the version test
    at the third: either test is the proof on the sampling path)."""
    tok = parts[0]
    prompts = sixteen_prompts(tok)
    ctl, learner = build(parts, student_dir, JitteryStaleWorker, "hf_reference", "bfloat16", lr, proof="probe")
    gate(ctl, prompts, "hf_reference")
    ctl.step(prompts, PARAMS)  # v0 samples v0
    with pytest.raises(SamplerGapError, match=r"generation path that kept"):
        for _ in range(by_step):
            ctl.step(prompts, PARAMS)
    assert 1 <= learner.version <= by_step  # the refused step's update was not applied


@pytest.mark.parametrize("backend", ["hf_reference", "hf_cached"])
def test_lora_dropout_does_not_enter_the_gap(parts, student_dir, backend):
    """The update's forward drops adapter inputs; the gap is taken on the policy itself (an eval forward), so an
    honest fp32 replica sits at rounding, not at dropout's noise."""
    dropped = dataclasses.replace(LORA, dropout=0.5)
    _, prompts, _, scorer = parts
    learner = LearnerWorker(str(student_dir), dropped, "float32", GKD, 5e-2, 0.0, 1.0, 2, CPU)
    rollout = RolloutWorker(backend, str(student_dir), dropped, "float32", CPU)
    for _ in range(3):  # v0's lora_B is 0, where dropout changes nothing; v1 and v2 are not
        rollout.load_policy(learner.publish_policy())
        batch = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, stop_token_ids=(2,)))
        metrics = learner.update(batch, scorer.score(batch, 0, 1.0), None)
        assert metrics["sampler_gap_mean"] < 1e-5, metrics["sampler_gap_mean"]
    assert learner.model.training or not any(m.training for m in learner.model.modules())
    assert torch.is_grad_enabled()
