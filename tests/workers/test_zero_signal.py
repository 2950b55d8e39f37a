"""A zero signal leaves the model alone: with teacher = student the learner's adapter does not move, step after step,
under each objective and GKD path (full vocabulary; top-K + tail through the closed-form LM head); a real teacher
moves it (the positive control: the check can fail)."""

from __future__ import annotations

import random

import pytest
import torch

from miniverl.batches import PromptBatch
from miniverl.config.objective import GkdObjectiveConfig, PgK1ObjectiveConfig
from miniverl.data.tasks import reverse_task
from miniverl.models.lora import LoraSettings
from miniverl.objectives import build_objective
from miniverl.process import ProcessSettings
from miniverl.rollout.sampling import SamplingParams
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "up_proj"), init_seed=0)
CPU = ProcessSettings("cpu", torch_threads=1)
LR = 2e-3  # trainer.lr's default
STEPS = 3
# Before the fix the first step alone moved the largest LoRA B entry by 0.2 x lr (GKD, fp32; PG-k1: about 1 x lr)
# and every later step by about lr. Allowed: a thousandth of one step.
DRIFT_BOUND = 1e-3 * LR

OBJECTIVES = {
    "gkd_full": GkdObjectiveConfig(teacher_topk=0),
    "gkd_top8": GkdObjectiveConfig(teacher_topk=8),  # K < V: the scorer ships top-K + tail, the closed-form head
    "pg_k1": PgK1ObjectiveConfig(),
}


def train(student_dir, teacher_dir, name: str) -> tuple[float, list[float]]:
    """STEPS on-policy steps of objective `name` (its config defaults, signal_floor included) from the student, the
    teacher scoring. Returns the largest change of any adapter entry and each step's loss."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    objective = build_objective(OBJECTIVES[name])
    learner = LearnerWorker(str(student_dir), LORA, "float32", objective, LR, 0.0, 1.0, 16, CPU)
    rollout = RolloutWorker("hf_cached", str(student_dir), LORA, "float32", CPU)
    scorer = ScorerWorker(str(teacher_dir), "float32", 16, CPU)
    tok = AutoTokenizer.from_pretrained(str(student_dir))
    start = [p.detach().clone() for p in learner.params]
    rng = random.Random(1)
    losses = []
    for step in range(STEPS):
        examples = [reverse_task(rng, 3, 8) for _ in range(8)]
        ids = [tok(e.prompt)["input_ids"] for e in examples]
        prompts = PromptBatch(ids, [f"s{step}p{i}" for i in range(8)], [e.answer for e in examples])
        rollout.load_policy(learner.publish_policy())
        params = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, stop_token_ids=(tok.eos_token_id,), seed=step)
        batch = rollout.generate(prompts, params)
        scores = scorer.score(batch, objective.teacher_support_k, objective.loss_temperature)
        losses.append(learner.update(batch, scores, None)["loss"])
    drift = max(float((p.detach() - p0).abs().max()) for p, p0 in zip(learner.params, start))
    return drift, losses


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_teacher_equal_to_student_leaves_the_adapter_alone(name, student_dir):
    drift, losses = train(student_dir, student_dir, name)
    assert drift <= DRIFT_BOUND, f"{name}: the adapter moved by {drift:.2e} (bound {DRIFT_BOUND:.0e}) on a zero signal"
    assert max(abs(x) for x in losses) < 1e-9


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_real_teacher_moves_the_adapter(name, student_dir, teacher_dir):
    """The positive control: the same loop with a teacher that differs from the student learns."""
    drift, losses = train(student_dir, teacher_dir, name)
    assert drift > 0.1 * LR
    assert max(abs(x) for x in losses) > 1e-4
