"""One-step-stale rollouts (trainer.staleness=1), in-process: version accounting, the learner's refusal of a
larger lag, the sampler-gap check against the version that sampled, the time split, and resume."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miniverl.errors import PolicyMismatchError
from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.pg_k1 import PgK1Objective
from miniverl.objectives.sampler_check import SamplerGapError
from miniverl.rewards import ExactMatchReward
from miniverl.step.controller import StrictSyncController, overlap_seconds, span
from miniverl.workers.learner import LearnerWorker, StaleBatchError
from miniverl.workers.rollout import RolloutWorker
from tests.step.test_controller import CPU, LORA, PARAMS

TIMES = ("time/refresh", "time/generate", "time/score", "time/update")


def learner(student_dir, staleness: int, objective=None, lr: float = 5e-2) -> LearnerWorker:
    objective = objective or GkdObjective(0.5, 1.0, 0)
    return LearnerWorker(str(student_dir), LORA, "float32", objective, lr, 0.0, 1.0, 2, CPU, staleness=staleness)


@pytest.fixture()
def stale(parts, student_dir):
    """A learner that allows a lag of one version, a rollout worker and the scorer."""
    tok, prompts, _, scorer = parts
    return (
        tok,
        prompts,
        learner(student_dir, 1, lr=1e-2),
        RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU),
        scorer,
    )


def controller(stale, staleness: int = 1) -> StrictSyncController:
    tok, _, lrn, rollout, scorer = stale
    return StrictSyncController(rollout, scorer, lrn, ExactMatchReward(tok), 0, 1.0, staleness=staleness)


def params(step: int):
    return dataclasses.replace(PARAMS, seed=100 + step)


def test_the_learner_accepts_a_lag_up_to_staleness_and_refuses_more_with_the_numbers(stale):
    _, prompts, lrn, rollout, scorer = stale
    rollout.load_policy(lrn.publish_policy())
    v0 = rollout.generate(prompts, PARAMS)
    s0 = scorer.score(v0, 0, 1.0)
    lrn.update(v0, s0, None)  # lag 0
    lrn.publish_policy()
    metrics = lrn.update(v0, s0, None)  # lag 1 = trainer.staleness: accepted
    assert lrn.version == 2 and "policy_drift_mean" in metrics
    lrn.publish_policy()
    with pytest.raises(
        StaleBatchError, match="v2 .*sampled by v0: its lag of 2 versions exceeds trainer.staleness=1"
    ) as e:
        lrn.update(v0, s0, None)
    assert (e.value.batch_version, e.value.learner_version, e.value.staleness, e.value.lag) == (0, 2, 1, 2)
    assert isinstance(e.value, PolicyMismatchError) and lrn.version == 2  # nothing applied


def test_strict_sync_refuses_a_lag_of_one(parts, student_dir):
    _, prompts, lrn, scorer = parts  # staleness 0
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    rollout.load_policy(lrn.publish_policy())
    batch = rollout.generate(prompts, PARAMS)
    lrn.update(batch, scorer.score(batch, 0, 1.0), None)
    lrn.publish_policy()
    with pytest.raises(StaleBatchError, match="lag of 1 versions exceeds trainer.staleness=0"):
        lrn.update(batch, scorer.score(batch, 0, 1.0), None)


def test_a_batch_from_before_a_restore_or_from_the_future_is_refused(stale, tmp_path):
    _, prompts, lrn, rollout, scorer = stale
    rollout.load_policy(lrn.publish_policy())
    v0 = rollout.generate(prompts, PARAMS)
    s0 = scorer.score(v0, 0, 1.0)
    lrn.update(v0, s0, None)
    saved = lrn.save_checkpoint(str(tmp_path / "ckpt"))
    lrn.load_checkpoint(saved)  # v1 restored: its process never published v0
    lrn.publish_policy()
    with pytest.raises(StaleBatchError, match="never published v0"):
        lrn.update(v0, s0, None)
    ahead = dataclasses.replace(v0, policy_version=5)
    with pytest.raises(StaleBatchError, match="has not reached"):
        lrn.update(ahead, s0, None)


def test_a_stale_run_trains_each_step_on_the_previous_versions_rollout(stale):
    _, prompts, lrn, _, _ = stale
    ctl = controller(stale)
    steps = [ctl.step(prompts, params(k), (prompts, params(k + 1)) if k < 3 else None) for k in range(4)]
    assert [m["policy_version"] for m in steps] == [0, 0, 1, 2]  # step k+1 sampled from v_k
    assert [m["staleness"] for m in steps] == [0, 1, 1, 1]
    assert lrn.version == 4 and ctl.in_flight is None  # the last step submits nothing
    assert ctl.sync.refreshes == 4  # v0..v3 proven once each; v4 was never asked for
    for m in steps:
        assert m["time/step"] == pytest.approx(sum(m[k] for k in TIMES), rel=1e-9)
        assert m["time/overlap"] == 0.0  # in-process every call runs to its end before the next
    # The sampler gap is measured against the version that sampled (same fp32 weights on both sides), while
    # the policy being updated has moved one version away from it.
    for m in steps[1:]:
        assert m["sampler_gap_mean"] < 1e-4 < m["policy_drift_mean"]
    assert steps[0]["policy_drift_mean"] == pytest.approx(steps[0]["sampler_gap_mean"])


def test_one_behind_the_next_rollout_is_scored_behind_it_and_the_numbers_do_not_change(parts, student_dir, monkeypatch):
    """The in-flight rollout's teacher scores are submitted with it (the scorer takes the rollout by reference and
    starts when it ends, beside the update) and the next step trains on them: the same numbers as scoring it after
    the rollout is collected, since the teacher does not depend on the policy."""
    tok, prompts, _, scorer = parts
    runs = {}
    for name in ("behind", "after"):
        if name == "after":
            monkeypatch.setattr(StrictSyncController, "score_behind", lambda self, flight: flight)
        lrn = learner(student_dir, 1, lr=1e-2)
        ctl = controller(
            (tok, prompts, lrn, RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU), scorer)
        )
        runs[name] = []
        for k in range(3):
            runs[name].append(ctl.step(prompts, params(k), (prompts, params(k + 1)) if k < 2 else None))
            if k < 2:
                assert (ctl.in_flight.score is not None) == (name == "behind")
    for a, b in zip(runs["behind"], runs["after"], strict=True):
        for key in ("loss", "reverse_kl", "grad_norm", "policy_version", "staleness", "sampler_gap_mean"):
            assert a[key] == b[key], key


class Recorder:
    """An actor stand-in that logs which of its methods the controller calls, in the order it calls them."""

    def __init__(self, role: str, worker, calls: list[str]) -> None:
        self._role, self._worker, self._calls = role, worker, calls

    def __getattr__(self, name: str):
        method = getattr(self._worker, name)

        def call(*args):
            self._calls.append(f"{self._role}.{name}")
            return method(*args)

        return call


def test_one_behind_the_update_is_submitted_before_the_next_rollouts_scoring(stale):
    """Calls from one driver to one actor run in submission order, so with the roles in one actor
    (resources.colocate) a scoring submitted before the update held the update until the next rollout had ended:
    decode-profile run 8 measured 5.64 s a step with no overlap, against 4.85 s without scoring behind. The
    controller submits the next rollout, then this step's update, then the next rollout's scoring."""
    tok, prompts, lrn, rollout, scorer = stale
    calls: list[str] = []
    ctl = StrictSyncController(
        Recorder("rollout", rollout, calls),
        Recorder("scorer", scorer, calls),
        Recorder("learner", lrn, calls),
        ExactMatchReward(tok),
        0,
        1.0,
        staleness=1,
    )
    ctl.step(prompts, params(0), (prompts, params(1)))
    calls.clear()
    ctl.step(prompts, params(1), (prompts, params(2)))
    work = [c for c in calls if c in ("rollout.generate", "scorer.score", "learner.update")]
    assert work == ["rollout.generate", "learner.update", "scorer.score"], calls
    assert ctl.in_flight is not None and ctl.in_flight.score is not None


def test_with_two_scorers_the_rollout_in_flight_is_scored_after_it(stale):
    """Several replicas pad their rows to their own widths, while the learner gets rows of the stacked batch: the
    scores behind a flight are for one rollout replica and one scorer only."""
    tok, prompts, lrn, rollout, scorer = stale
    ctl = StrictSyncController(rollout, [scorer, scorer], lrn, ExactMatchReward(tok), 0, 1.0, staleness=1)
    ctl.step(prompts, params(0), (prompts, params(1)))
    assert ctl.in_flight is not None and ctl.in_flight.score is None
    assert ctl.step(prompts, params(1))["staleness"] == 1


def test_strict_sync_logs_no_lag_and_no_drift(parts, student_dir):
    tok, prompts, lrn, scorer = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    ctl = StrictSyncController(rollout, scorer, lrn, ExactMatchReward(tok), 0, 1.0)
    steps = [ctl.step(prompts, params(k), (prompts, params(k + 1))) for k in range(2)]  # upcoming is ignored
    assert [m["policy_version"] for m in steps] == [0, 1] and [m["staleness"] for m in steps] == [0, 0]
    assert ctl.in_flight is None and "policy_drift_mean" not in steps[1]


def test_a_sampler_that_is_another_policy_is_still_caught_one_version_behind(stale):
    """Against the current policy the check would mix the sampler's error with a real update; against the
    version that sampled it sees only the sampler: 0.6 nats off on every token is refused at lag 1."""
    _, prompts, lrn, rollout, scorer = stale
    rollout.load_policy(lrn.publish_policy())
    v0 = rollout.generate(prompts, PARAMS)
    s0 = scorer.score(v0, 0, 1.0)
    lrn.update(v0, s0, None)
    lrn.publish_policy()
    off = (v0.rollout_log_probs - 0.6) * v0.response_mask
    with pytest.raises(SamplerGapError, match=r"mean 0\.6 .*from the learner's v1"):
        lrn.update(dataclasses.replace(v0, rollout_log_probs=off), s0, None)
    assert lrn.version == 1


def test_a_large_honest_update_is_reported_as_drift_not_refused_as_a_sampler_gap(stale, student_dir):
    """One huge step moves the policy far from the version that sampled; the sampler still serves exactly what
    the learner computes under that version, so the step trains. Compared against the current policy, GKD's
    0.5-nat bound would have refused it (the default run's first update alone moves 0.6 nats: measured)."""
    _, prompts, _, rollout, scorer = stale
    lrn = learner(student_dir, 1, lr=5.0)
    rollout.load_policy(lrn.publish_policy())
    v0 = rollout.generate(prompts, PARAMS)
    s0 = scorer.score(v0, 0, 1.0)
    lrn.update(v0, s0, None)
    lrn.publish_policy()
    metrics = lrn.update(v0, s0, None)
    assert lrn.version == 2 and metrics["sampler_gap_mean"] < 1e-4
    assert metrics["policy_drift_mean"] > lrn.objective.sampler_tolerance.max_mean_gap  # beyond the gap's bound
    assert metrics["ratio_max"] > 1.0


def test_pg_k1_one_version_behind_takes_its_advantage_from_the_current_policy(stale, student_dir, monkeypatch):
    _, prompts, _, rollout, scorer = stale
    lrn = learner(student_dir, 1, PgK1Objective(0.0, 2.0, 0.0, "k1", 0.0), lr=1e-2)
    rollout.load_policy(lrn.publish_policy())
    v0 = rollout.generate(prompts, PARAMS)
    s0 = scorer.score(v0, None, 1.0)
    lrn.update(v0, s0, None)
    lrn.publish_policy()
    current = lrn.policy_logprobs(v0)  # v1's log-probs of v0's tokens
    seen = []
    prepare = lrn.objective.prepare
    monkeypatch.setattr(lrn.objective, "prepare", lambda *a: seen.append(prepare(*a)) or seen[-1])
    metrics = lrn.update(v0, s0, None)
    mask = v0.response_mask.float()
    assert torch.allclose(seen[0], (s0.teacher_log_probs - current) * mask, atol=1e-6)
    assert not torch.allclose(seen[0], (s0.teacher_log_probs - v0.rollout_log_probs) * mask, atol=1e-3)
    assert metrics["clipped_ratio_frac"] >= 0 and metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-6)


def test_overlap_of_two_windows():
    assert overlap_seconds((0.0, 2.0), (1.5, 4.0)) == 0.5
    assert overlap_seconds((0.0, 1.0), (1.0, 2.0)) == 0.0 == overlap_seconds((3.0, 4.0), (0.0, 1.0))
    assert span([(1.0, 2.0), (0.5, 1.5)]) == (0.5, 2.0)


def run_stale_loop(stale, student_dir, run_dir, start: int = 0, checkpoint: str | None = None):
    """The loop in-process with trainer.staleness=1 (4 steps, a checkpoint every 2); from `checkpoint` a fresh
    learner and controller continue at `start`, as a resumed run does. Returns the per-step metrics."""

    from miniverl.cluster.faults import StopRequests
    from miniverl.observe.tracking import Tracker
    from miniverl.step.cadence import TrainingLoop
    from tests.step.test_cadence import loop_setup
    from tests.test_config import load

    tok, prompts, _, _, scorer = stale
    lrn = learner(student_dir, 1, lr=1e-2)
    first = None
    if checkpoint is not None:
        lrn.load_checkpoint(checkpoint)
        first = {"eval/reverse_kl": 0.0, "eval/accuracy": 0.0}
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    ctl = controller((tok, prompts, lrn, rollout, scorer))
    cfg = load(
        "rollout.max_new_tokens=5",
        "trainer.eval_every=0",
        "trainer.total_steps=4",
        "trainer.save_every=2",
        "trainer.staleness=1",
        "trainer.keep_checkpoints=4",
    )
    setup = loop_setup(tok, prompts, ctl.reward_fn, cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(run_dir, {}, "disabled", "p", None, cfg.trainer.total_steps, False, start)
    logged = []
    record = tracker.log
    tracker.log = lambda step, m, **kw: (logged.append((step, dict(m))), record(step, m, **kw))
    loop = TrainingLoop(cfg, setup, ctl, {"learner": [lrn]}, tracker, run_dir, {}, StopRequests())
    try:
        loop.run(start, first)
    finally:
        tracker.finish({})
    return {step: m for step, m in logged if step > 0}


def test_resume_discards_the_rollout_in_flight_and_is_a_pure_function_of_the_checkpoint(stale, student_dir, tmp_path):
    """A checkpoint does not hold the rollout in flight (it was sampled by the version before the checkpointed
    one): the resumed run samples its first step from the checkpointed policy (lag 0), then lags one version
    again; resuming the same checkpoint twice gives the same steps, bit for bit."""
    from miniverl.checkpoints.store import step_dir

    whole = run_stale_loop(stale, student_dir, tmp_path / "whole")
    assert [whole[k]["policy_version"] for k in (1, 2, 3, 4)] == [0, 0, 1, 2]
    checkpoint = str(step_dir(tmp_path / "whole", 2))
    first = run_stale_loop(stale, student_dir, tmp_path / "a", start=2, checkpoint=checkpoint)
    again = run_stale_loop(stale, student_dir, tmp_path / "b", start=2, checkpoint=checkpoint)
    assert sorted(first) == [3, 4]
    assert [(first[k]["policy_version"], first[k]["staleness"]) for k in (3, 4)] == [(2, 0), (2, 1)]
    untimed = [{k: v for k, v in first[s].items() if not k.startswith(("time/", "rollout_tokens"))} for s in (3, 4)]
    assert untimed == [
        {k: v for k, v in again[s].items() if not k.startswith(("time/", "rollout_tokens"))} for s in (3, 4)
    ]


def run_loop_recording(parts, student_dir, run_dir, staleness: int) -> dict:
    """The loop in-process on a real prompt stream (other prompts each step), 4 steps with an evaluation
    every 2; records what each learner update was given and the steps that were evaluated."""
    from miniverl.cluster.faults import StopRequests
    from miniverl.data.prompts import PromptSource
    from miniverl.observe.tracking import Tracker
    from miniverl.step.cadence import TrainingLoop
    from tests.step.test_cadence import loop_setup
    from tests.test_config import load

    tok, prompts, _, scorer = parts
    lrn = learner(student_dir, staleness, lr=1e-2)
    updates = []
    update = lrn.update
    lrn.update = lambda batch, *a, **kw: (
        updates.append((batch.uid, batch.ground_truth, batch.prompts)),
        update(batch, *a, **kw),
    )[1]
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    ctl = StrictSyncController(rollout, scorer, lrn, ExactMatchReward(tok), 0, 1.0, staleness=staleness)
    cfg = load(
        "rollout.max_new_tokens=5",
        "data.prompts_per_step=2",
        "trainer.eval_every=2",
        "trainer.total_steps=4",
        "trainer.save_checkpoint=false",
        f"trainer.staleness={staleness}",
    )
    setup = loop_setup(tok, prompts, ctl.reward_fn, cfg)
    setup.prompts = PromptSource("reverse", 2, 4, tok, 16, 7)
    run_dir.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(run_dir, {}, "disabled", "p", None, cfg.trainer.total_steps, False)
    evaluated = []
    record = tracker.log
    tracker.log = lambda step, m, **kw: (evaluated.extend([step] * ("eval/reverse_kl" in m)), record(step, m, **kw))
    loop = TrainingLoop(cfg, setup, ctl, {"learner": [lrn]}, tracker, run_dir, {}, StopRequests())
    try:
        loop.run(0, None)
    finally:
        tracker.finish({})
    state = lrn.optimizer.state_dict()
    return {
        "updates": updates,
        "evaluated": evaluated,
        "version": lrn.version,
        "optimizer_steps": {float(s["step"]) for s in state["state"].values()},
        "lr": [g["lr"] for g in state["param_groups"]],
    }


def test_a_stale_run_trains_on_the_same_prompts_as_strict_sync_with_as_many_updates_and_evaluations(
    parts, student_dir, tmp_path
):
    """The lag changes which policy samples a step's prompts, nothing else: the same prompt groups in the same
    order, one optimizer step per step at the same learning rate (no schedule), evaluations at the same steps
    (lab/results/staleness-cpu.md, "Seeds 2-4": the stale runs' lower final reverse KL is not more data)."""
    strict = run_loop_recording(parts, student_dir, tmp_path / "strict", 0)
    stale = run_loop_recording(parts, student_dir, tmp_path / "stale", 1)
    assert len(strict["updates"]) == len(stale["updates"]) == 4
    for (uid0, truth0, ids0), (uid1, truth1, ids1) in zip(strict["updates"], stale["updates"]):
        assert uid0 == uid1 and truth0 == truth1 and torch.equal(ids0, ids1)
    assert len({tuple(u[1]) for u in strict["updates"]}) == 4  # the stream gives each step other prompts
    assert strict["evaluated"] == stale["evaluated"] == [0, 2, 4]
    assert strict["version"] == stale["version"] == 4
    assert strict["optimizer_steps"] == stale["optimizer_steps"] == {4.0}
    assert strict["lr"] == stale["lr"] == [1e-2]
