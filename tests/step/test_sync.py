"""One owner of the served policy (miniverl/step/sync.py): a stale replica is caught at its first stale refresh
in any dtype and at any learning rate, an honest one never is, and a run refreshes updates + 1 times."""

from __future__ import annotations

import pytest

from miniverl.errors import PolicyMismatchError
from miniverl.objectives.gkd import GkdObjective
from miniverl.rewards import ExactMatchReward
from miniverl.step.conformance import conformance_gate
from miniverl.step.controller import StrictSyncController
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from tests.step.test_controller import CPU, LORA, PARAMS, StaleRolloutWorker


def build(parts, student_dir, rollout_cls, backend: str, dtype: str, lr: float, proof: str = "digest", **kwargs):
    """`proof`: digest (the default cadence: the run's first refresh probes, the next ones are proven by the
    served digest) or probe (the replica reports no served digest, as vLLM: every refresh is probed)."""
    tok, _, _, scorer = parts
    learner = LearnerWorker(str(student_dir), LORA, dtype, GkdObjective(0.5, 1.0, 0), lr, 0.0, 1.0, 2, CPU)
    rollout = rollout_cls(backend, str(student_dir), LORA, dtype, CPU)
    if proof == "probe":
        rollout.backend.served_digest = lambda: None
    return StrictSyncController(rollout, scorer, learner, ExactMatchReward(tok), 0, 1.0, **kwargs), learner


def gate(ctl, prompts, backend: str, lines=None) -> dict:
    """The conformance gate of a GKD run (step/conformance.py): it calibrates the bound every step is held to."""
    log = (lambda *_: None) if lines is None else lines.append
    return conformance_gate(ctl, prompts, PARAMS, GkdObjective(0.5, 1.0, 0), ("gkd", backend), log)


# How each proof names a stale replica: the digest read from its serving buffers, or the probe's change test (or,
# when a step moved the probe that far, its gap test).
STALE = {
    "digest": "rollout replica 0 serves an adapter whose digest .* is not that of the published v1",
    "probe": "rollout replica 0 serves (the )?probe log-probs",
}


@pytest.mark.parametrize("proof", ["digest", "probe"])
@pytest.mark.parametrize("backend", ["hf_reference", "hf_cached"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lr", [2e-3, 2e-4, 2e-5])
def test_a_stale_replica_is_caught_at_its_first_stale_refresh(parts, student_dir, backend, dtype, lr, proof):
    """In bf16 a step moves the probe by hundredths of a nat, far inside the 0.75-nat gap tolerance (main
    trained 17 steps on v0's samples at lr 2e-4 and never stopped at 2e-5): the served digest catches it
    (exact bits, whatever the step), and without one the probe's change test does."""
    prompts = parts[1]
    ctl, learner = build(parts, student_dir, StaleRolloutWorker, backend, dtype, lr, proof)
    ctl.step(prompts, PARAMS)  # v0: the first load is honest
    with pytest.raises(PolicyMismatchError, match=STALE[proof]):
        ctl.step(prompts, PARAMS)  # v1 acknowledged, v0 served
    assert learner.version == 1  # not one update on stale samples


HONEST_STEPS = 100


@pytest.mark.parametrize(
    ("backend", "dtype", "lr"),
    [("hf_cached", "bfloat16", 2e-5), ("hf_cached", "float32", 2e-3), ("hf_reference", "bfloat16", 2e-3)],
)
def test_an_honest_replica_is_never_flagged(parts, student_dir, backend, dtype, lr):
    """100 CPU steps after the conformance gate, each one refresh proven by the served digest and by a probe the
    learner moved, each step's sampler gap held to the bound the gate calibrated: no false alarm from the digest,
    either probe test or the per-step bound (lab/measurements/sampler_gap_faults.py counts 1,000 steps a cell)."""
    prompts = parts[1]
    ctl, learner = build(parts, student_dir, RolloutWorker, backend, dtype, lr, probe_every=1)
    gate(ctl, prompts, backend)
    assert learner.sampler_gap.bound.source == "gate"
    moved, served, noise = [], [], []
    for _ in range(HONEST_STEPS):
        metrics = ctl.step(prompts, PARAMS)
        moved.append(metrics["probe_learner_moved"])
        served.append(metrics["probe_served_moved"])
        noise.append(metrics["probe_noise"])
    assert learner.version == HONEST_STEPS and ctl.sync.refreshes == ctl.sync.probed == HONEST_STEPS
    assert ctl.sync.by_digest == [True]  # every refresh was digested too
    assert sum(m > 0 for m in moved) >= HONEST_STEPS - 1  # every refresh after the first had a move to follow
    assert sum(m > 0 for m in served) >= HONEST_STEPS - 1 and set(noise) == {0.0}  # HF backends: bit-identical


def test_refreshes_between_probes_are_proven_by_the_served_digest(parts, student_dir):
    """probe_every=4 over 10 refreshes: the probe runs at refreshes 0, 4 and 8 (and the change test then compares
    two versions four updates apart); every refresh is digested."""
    prompts = parts[1]
    ctl, learner = build(parts, student_dir, RolloutWorker, "hf_cached", "bfloat16", 2e-5, probe_every=4)
    ran = [ctl.step(prompts, PARAMS)["probe_ran"] for _ in range(10)]
    assert ran == [1, 0, 0, 0, 1, 0, 0, 0, 1, 0] and ctl.sync.probed == 3
    assert ctl.sync.refreshes == learner.version == 10 and "probe_gap_max" not in ctl.last_probe


class AdapterDroppingWorker(RolloutWorker):
    """Serves the base model whatever it is sent (lora_B zeroed): exact at v0, where lora_B is 0."""

    def load_policy(self, snapshot):
        dropped = {k: v * 0 if "lora_B" in k else v for k, v in snapshot.weights.items()}
        return super().load_policy(type(snapshot)(snapshot.identity, dropped))


@pytest.mark.parametrize("proof", ["digest", "probe"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_gate_serves_a_non_zero_adapter_first(parts, student_dir, dtype, proof):
    """At v0 a replica that drops the adapter serves exactly the published policy; the gate's trial adapter
    exposes it before any step (the served digest at once; without one, fp32: the probe's gap; bf16: the change
    test at v0's refresh)."""
    ctl, learner = build(parts, student_dir, AdapterDroppingWorker, "hf_cached", dtype, 1e-3, proof)
    ctl.ensure_served()  # v0 alone: passes
    ctl, learner = build(parts, student_dir, AdapterDroppingWorker, "hf_cached", dtype, 1e-3, proof)
    with pytest.raises(PolicyMismatchError, match="rollout replica 0 serves"):
        ctl.sync.prove_trial_adapter()
        ctl.ensure_served()
    assert learner.version == 0 and ctl.sync.refreshes == 0


def test_an_honest_replica_passes_the_trial_adapter(parts, student_dir):
    ctl, learner = build(parts, student_dir, RolloutWorker, "hf_cached", "bfloat16", 1e-3)
    assert ctl.sync.prove_trial_adapter() <= ctl.sync.tolerances[0]
    assert ctl.ensure_served().version == 0 and ctl.sync.last_probe["probe_learner_moved"] > 0
    assert ctl.sync.refreshes == 1 and learner.published.version == 0


def test_refresh_stages_are_timed_in_the_order_the_actors_run_them(monkeypatch):
    """time/refresh/<stage>: each stage's share is the wait for its handles after the previous stage ended."""
    import time

    import miniverl.step.sync as sync

    costs = {"a": 0.05, "b": 0.0, "c": 0.1}
    monkeypatch.setattr(sync, "settle", lambda handles: time.sleep(costs[handles[0]]))
    split = sync._stage_times([("first", ["a"]), ("second", ["b"]), ("third", ["c"])])
    assert list(split) == ["time/refresh/first", "time/refresh/second", "time/refresh/third"]
    assert split["time/refresh/first"] >= 0.05 and split["time/refresh/third"] >= 0.1
    assert split["time/refresh/second"] < 0.05


def test_a_step_logs_the_refresh_split_beside_its_total(parts, student_dir):
    """In-process every stage has run before it is waited for: the split is logged and sums within the total."""
    ctl, _ = build(parts, student_dir, RolloutWorker, "hf_reference", "float32", 1e-4)
    metrics = ctl.step(parts[1], PARAMS)
    stages = [k for k in metrics if k.startswith("time/refresh/")]
    parts_ = ("learner_probe", "publish", "load", "served_digest", "served_probe")
    assert sorted(stages) == sorted(f"time/refresh/{s}" for s in parts_)
    assert sum(metrics[k] for k in stages) <= metrics["time/refresh"]


class OnGpu:
    """An actor that reports which physical GPU it is on (None: the CPU)."""

    def __init__(self, uuid):
        self.uuid = uuid

    def device_uuid(self):
        return self.uuid


@pytest.mark.parametrize(
    ("weight_sync", "learner", "replicas", "on_device"),
    [
        ("auto", "GPU-a", ["GPU-a", "GPU-a"], True),
        ("auto", "GPU-a", ["GPU-a", "GPU-b"], False),  # one replica on another GPU: everything through the host
        ("auto", None, [None], False),  # the CPU
        ("host", "GPU-a", ["GPU-a"], False),
    ],
)
def test_the_adapter_stays_on_the_device_only_when_every_replica_shares_the_learners_gpu(
    weight_sync, learner, replicas, on_device
):
    from miniverl.step.sync import PolicySync

    sync = PolicySync([OnGpu(u) for u in replicas], [OnGpu(learner)], weight_sync=weight_sync)
    assert sync._shares_the_learners_gpu() is on_device


def test_an_unknown_weight_sync_is_refused():
    from miniverl.step.sync import PolicySync

    with pytest.raises(ValueError, match="weight_sync must be one of"):
        PolicySync([], [], weight_sync="nvlink")


def test_a_cpu_run_publishes_through_the_host(parts, student_dir):
    prompts = parts[1]
    ctl, learner = build(parts, student_dir, RolloutWorker, "hf_cached", "float32", 2e-3)
    ctl.step(prompts, PARAMS)
    assert ctl.sync.on_device is False and learner.publisher._outbox._shared is None  # no CUDA IPC handle was made
