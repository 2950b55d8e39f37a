"""The run's sequential sampler tests in the learner (objectives/sequential_check.py through workers/sampler_gap.py):
a sampler gap that drifts up step after step, each step under the per-step bound, is stopped before the crossing
step's update, at 4 rows, where the per-step version test does not vote."""

from __future__ import annotations

import math

import pytest

from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.sampler_check import SamplerGapError
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from tests.step.test_controller import CPU, LORA, PARAMS


def test_a_gap_drifting_under_the_per_step_bound_is_stopped_by_the_runs_evidence(parts, student_dir):
    _, prompts, _, scorer = parts
    learner = LearnerWorker(str(student_dir), LORA, "float32", GkdObjective(0.5, 1.0, 0), 0.0, 0.0, 1.0, 2, CPU)
    honest_mean, p99 = 1e-3, 1e-2
    learner.calibrate_sampler_gap(honest_mean, p99, 0.0)  # as the gate does: the bound and the sequential tests
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    seen = []
    for step in range(1, 9):
        rollout.load_policy(learner.publish_policy())
        batch = rollout.generate(prompts, PARAMS)
        tokens = int(batch.response_mask.sum())
        unit = p99 / math.sqrt(tokens)  # the gap's z unit: the gate's spread over sqrt(tokens)
        batch.rollout_log_probs -= (honest_mean + step * unit) * batch.response_mask  # z = step: drifting up
        assert honest_mean + step * unit < learner.sampler_gap.bound.mean_at(tokens)  # each step under the bound
        try:
            metrics = learner.update(batch, scorer.score(batch, 0, 1.0), None)
        except SamplerGapError as e:
            assert "CUSUM of each step's mean |gap|" in str(e) and "the update was not applied" in str(e)
            break
        seen.append((metrics["sampler_gap_z"], metrics["sampler_gap_cusum"]))
    assert len(batch) == 4 and [z for z, _ in seen] == pytest.approx([1.0, 2.0, 3.0], abs=1e-3)
    assert [s for _, s in seen] == pytest.approx([0.0, 1.0, 3.0], abs=1e-3)  # step 4 reaches 6 > 5.2
    assert learner.version == 3  # steps 1-3 applied; the refused step 4 was not
