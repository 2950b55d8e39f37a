"""The sequential sampler tests (objectives/sequential_check.py): one-sided CUSUMs of the per-step gap, in the gate's
own units, and of the version comparisons' token evidence; a slow drift each step passes is stopped, honest statistics
never are."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.ratios import STEP_MEAN_FLOOR, STEP_SPREAD_Z
from miniverl.objectives.sampler_check import (
    VERSION_TESTS,
    VOTE_SUMS,
    SamplerGapError,
    evidence_sums,
    judge_step,
    token_evidence,
    vote_sums,
)
from miniverl.objectives.sequential_check import (
    CUSUM_ALLOWANCE,
    CUSUM_THRESHOLD,
    Cusum,
    SequentialSamplerTests,
    evidence_step_z,
    gap_z,
    in_control_run_length,
)

GKD = GkdObjective(0.5, 1.0, 0)
# A bf16 gate of the built-in models on hf_cached (lab/results/sampler-gap/cpu-bf16-honest1000-version.json): its
# honest mean, p99 and per-token std of |gap|, nats.
GATE = (0.0088, 0.0527, 0.0116)
TOKENS = 64  # a step of 8 rows of about 8 tokens
NO_VOTES = [0.0] * VOTE_SUMS * len(VERSION_TESTS)


def bound():
    return GKD.sampler_tolerance.step_bound(*GATE)


def armed() -> SequentialSamplerTests:
    tests = SequentialSamplerTests()
    tests.calibrate(GATE[0])
    return tests


def test_the_threshold_bounds_false_alarms_of_all_three_tests_together():
    # Any of the gap's and the two version comparisons' tests: on average no sooner than 10,000 honest steps
    assert in_control_run_length(CUSUM_ALLOWANCE, CUSUM_THRESHOLD) / (1 + len(VERSION_TESTS)) >= 10_000


def test_standard_normal_steps_run_at_least_the_bound_before_a_false_alarm():
    """The bound by simulation: 2,000 CUSUMs of standard-normal z (a null wider than honest steps measured), each
    10,000 steps; the share that alarmed within them is no more than an average run length >= 32,860 allows."""
    gen = torch.Generator().manual_seed(0)
    runs, steps = 2_000, 10_000
    s = torch.zeros(runs, dtype=torch.float64)
    alarmed = torch.zeros(runs, dtype=torch.bool)
    for _ in range(steps):
        s = (s + torch.randn(runs, generator=gen, dtype=torch.float64) - CUSUM_ALLOWANCE).clamp_min(0)
        alarmed |= s > CUSUM_THRESHOLD
    # geometric in-control run lengths of mean >= 32,860: P(alarm within 10,000) <= 1 - exp(-10,000 / 32,860) = 0.26
    assert alarmed.float().mean() <= 1 - math.exp(-steps / in_control_run_length(CUSUM_ALLOWANCE, CUSUM_THRESHOLD))


def test_the_gap_z_is_in_the_gates_own_spread_units_with_the_bounds_floor():
    b = bound()
    unit = max(GATE[1], GATE[2]) / math.sqrt(TOKENS)  # the p99, the larger, as the per-step bound's spread
    assert gap_z(GATE[0] + 2 * unit, TOKENS, b, GATE[0]) == pytest.approx(2.0)
    assert gap_z(GATE[0], TOKENS, b, GATE[0]) == 0.0
    fp32 = GKD.sampler_tolerance.step_bound(4e-7, 3e-6, 1e-7)  # rounding alone: the floor is the unit
    assert gap_z(4e-7 + STEP_MEAN_FLOOR, 10**6, fp32, 4e-7) == pytest.approx(STEP_SPREAD_Z)


def comparison(votes: torch.Tensor, evidence: torch.Tensor) -> list[float]:
    """One version comparison's VOTE_SUMS sums: its rows' votes and its tokens' evidence."""
    return vote_sums(votes, evidence.numel()) + evidence_sums(evidence)


def test_a_token_is_evidence_for_the_policy_its_sampler_log_prob_sits_nearer_bounded_by_their_distance():
    learner, older = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.02, -2.0, -0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    honest = token_evidence(learner + 0.005, learner, older, mask)  # rounding below the policies' distance
    assert honest.tolist() == pytest.approx([-0.02, 0.0])  # against the older policy by its distance; 0 where equal
    assert token_evidence(older - 0.005, learner, older, mask).tolist() == pytest.approx([0.02, 0.0])  # mirror
    far = token_evidence(learner + 5.0, learner, older, mask)  # a token far out in the rounding
    assert far.abs().max() <= 0.02 + 1e-12  # weighs no more than the policies' distance


def test_the_token_evidence_z_is_self_normalized_and_standard_at_any_token_count():
    """Evidence symmetric about 0 (policies within the rounding), of heavy-tailed magnitudes: the step z sum /
    root of squares has mean 0 and spread at most 1 at 8 tokens as at 512; tokens all alike give sqrt(tokens)."""
    gen = torch.Generator().manual_seed(2)
    for tokens in (8, 512):
        magnitudes = torch.empty(4000, tokens).exponential_(generator=gen) ** 2
        signs = torch.randint(0, 2, (4000, tokens), generator=gen) * 2 - 1
        zs = torch.tensor([evidence_step_z(comparison(torch.zeros(1), e)) for e in magnitudes * signs])
        assert abs(float(zs.mean())) < 0.05 and float(zs.std()) < 1.03
    assert evidence_step_z(comparison(torch.zeros(8), torch.full((50,), 0.003))) == pytest.approx(math.sqrt(50))
    assert evidence_step_z(comparison(torch.zeros(2), torch.tensor([0.5, -0.5]))) == 0.0
    assert evidence_step_z(comparison(torch.zeros(8), torch.zeros(64))) is None and evidence_step_z(NO_VOTES) is None


def test_a_slowly_drifting_gap_each_step_passes_is_stopped_within_a_few_steps():
    """A stale sampler's mean gap rising by one spread unit a step: the per-step bound passes all seven steps (it sits
    six units up, plus twice the honest mean), the CUSUM stops the fourth, before its update."""
    tests, b = armed(), bound()
    unit = max(GATE[1], GATE[2]) / math.sqrt(TOKENS)
    caught = None
    for step in range(1, 8):
        mean = GATE[0] + step * unit
        try:
            judge_step(b, mean * TOKENS, mean, 0, NO_VOTES, TOKENS, step, step)  # the per-step tests pass it
        except SamplerGapError:
            pytest.fail(f"the per-step bound stopped step {step}: the drift is not below it")
        try:
            tests.observe(mean * TOKENS, TOKENS, b, NO_VOTES, step, step)
        except SamplerGapError as e:
            caught = step
            assert "CUSUM of each step's mean |gap|" in str(e) and "the update was not applied" in str(e)
            break
    assert caught == 4


def test_a_sampler_at_the_older_policy_is_stopped_by_its_tokens_evidence_below_the_version_tests_rows():
    """8 rows (the per-step version test votes from 16) a little nearer the base model: 24 of the 64 tokens sit
    nearer it by 0.01 nats, the rest in the rounding either way (step z 3): stopped at the third."""
    tests, b = armed(), bound()
    rounding = torch.tensor([0.01, -0.01]).repeat(20)
    stale = comparison(torch.full((8,), 0.2), torch.cat([torch.full((24,), 0.01), rounding]))
    honest = comparison(-torch.full((8,), 0.2), -torch.cat([torch.full((24,), 0.01), rounding]))
    for step in range(1, 4):
        votes = honest + stale  # VERSION_TESTS' order: the previous version (honest here), the base model
        if step < 3:
            metrics = tests.observe(GATE[0] * TOKENS, TOKENS, b, votes, step, step)
            assert metrics["sampler_vs_base_step_z"] == pytest.approx(3.0)
            assert metrics["sampler_vs_base_cusum"] == pytest.approx(step * (3.0 - CUSUM_ALLOWANCE))
            assert metrics["sampler_vs_previous_cusum"] == 0.0
        else:
            with pytest.raises(SamplerGapError, match=r"nearer the learner's base model .* CUSUM of each step's token"):
                tests.observe(GATE[0] * TOKENS, TOKENS, b, votes, step, step)


def test_honest_steps_from_the_calibrated_null_never_alarm_over_1000_steps():
    """1,000 steps whose tokens' gaps are drawn from the gate's own honest distribution (a half-normal scaled to its
    mean, with a p99-sized token in one step of four), and whose 8 rows' votes and tokens' evidence are symmetric
    about 0 (policies that do not differ: the version test's hardest null): no alarm, the statistics far below the
    threshold."""
    gen = torch.Generator().manual_seed(1)
    tests, b = armed(), bound()
    peak = dict.fromkeys(("sampler_gap_cusum", "sampler_vs_previous_cusum", "sampler_vs_base_cusum"), 0.0)
    for step in range(1, 1001):
        gaps = torch.randn(TOKENS, generator=gen).abs() * GATE[0] * math.sqrt(math.pi / 2)
        if step % 4 == 0:
            gaps[0] = GATE[1]
        votes = [
            x
            for _ in VERSION_TESTS
            for x in comparison(torch.rand(8, generator=gen) * 2 - 1, gaps * (torch.rand(TOKENS, generator=gen) - 0.5))
        ]
        metrics = tests.observe(float(gaps.sum()), TOKENS, b, votes, step, step)
        peak = {k: max(v, metrics[k]) for k, v in peak.items()}
    assert max(peak.values()) < CUSUM_THRESHOLD, peak


def test_the_statistic_drains_below_the_allowance_and_starts_again_at_calibration():
    c = Cusum()
    assert not c.add(3.0) and c.statistic == 2.0
    assert not c.add(0.0) and c.statistic == 1.0 and not c.add(-5.0) and c.statistic == 0.0
    tests = armed()
    tests.gap.add(5.0)
    tests.calibrate(GATE[0])
    assert tests.gap.statistic == 0.0
    unarmed = SequentialSamplerTests()  # before the gate: the gap is not observed (no honest mean)
    assert unarmed.observe(1.0 * TOKENS, TOKENS, bound(), NO_VOTES, 1, 1)["sampler_gap_cusum"] == 0.0
