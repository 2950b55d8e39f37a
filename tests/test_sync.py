"""One owner of the served policy (miniverl/sync.py): a stale replica is caught at its first stale refresh
in any dtype and at any learning rate, an honest one never is, and a run refreshes updates + 1 times."""

from __future__ import annotations

import pytest

from miniverl.controller import StrictSyncController
from miniverl.objectives.gkd import GkdObjective
from miniverl.protocol import PolicyMismatchError
from miniverl.rewards import ExactMatchReward
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from tests.test_controller import CPU, LORA, PARAMS, StaleRolloutWorker


def build(parts, student_dir, rollout_cls, backend: str, dtype: str, lr: float):
    tok, _, _, scorer = parts
    learner = LearnerWorker(str(student_dir), LORA, dtype, GkdObjective(0.5, 1.0, 0), lr, 0.0, 1.0, 2, CPU)
    rollout = rollout_cls(backend, str(student_dir), LORA, dtype, CPU)
    return StrictSyncController(rollout, scorer, learner, ExactMatchReward(tok), 0, 1.0), learner


@pytest.mark.parametrize("backend", ["hf_reference", "hf_cached"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lr", [2e-3, 2e-4, 2e-5])
def test_a_stale_replica_is_caught_at_its_first_stale_refresh(parts, student_dir, backend, dtype, lr):
    """In bf16 a step moves the probe by hundredths of a nat, far inside the 0.75-nat gap tolerance (main
    trained 17 steps on v0's samples at lr 2e-4 and never stopped at 2e-5): the change test catches it."""
    prompts = parts[1]
    ctl, learner = build(parts, student_dir, StaleRolloutWorker, backend, dtype, lr)
    ctl.step(prompts, PARAMS)  # v0: the first load is honest
    with pytest.raises(PolicyMismatchError, match="rollout replica 0 serves"):
        ctl.step(prompts, PARAMS)  # v1 acknowledged, v0 served
    assert learner.version == 1  # not one update on stale samples


HONEST_STEPS = 200


@pytest.mark.parametrize(("backend", "dtype", "lr"), [("hf_cached", "bfloat16", 2e-5), ("hf_cached", "float32", 2e-3)])
def test_an_honest_replica_is_never_flagged(parts, student_dir, backend, dtype, lr):
    """200 CPU steps, each one refresh whose probe the learner moved: no false alarm from either test."""
    prompts = parts[1]
    ctl, learner = build(parts, student_dir, RolloutWorker, backend, dtype, lr)
    moved = []
    for _ in range(HONEST_STEPS):
        metrics = ctl.step(prompts, PARAMS)
        moved.append(metrics["probe_learner_moved"])
    assert learner.version == HONEST_STEPS and ctl.sync.refreshes == HONEST_STEPS
    assert sum(m > 0 for m in moved) >= HONEST_STEPS - 1  # every refresh after the first had a move to follow
