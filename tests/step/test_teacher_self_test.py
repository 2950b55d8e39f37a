"""The gate's teacher self-test (step/conformance.py): the same rows scored twice repeat exactly in eval mode, and a
teacher with dropout on, a noisy scorer or non-finite scores stops the run naming the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from miniverl.batches import RolloutBatch, TeacherScores
from miniverl.errors import ConfigError
from miniverl.process import ProcessSettings
from miniverl.step.conformance import (
    TEACHER_REPEAT_BOUND,
    check_teacher_repeat,
    teacher_repeat_gap,
    teacher_self_test,
)
from miniverl.step.controller import StrictSyncController
from miniverl.workers.scorer import ScorerWorker

CPU = ProcessSettings("cpu", torch_threads=1)
BUILTIN_TEACHER = Path(__file__).resolve().parents[2] / "miniverl" / "models" / "shipped" / "reverse-affff8d0d847"
BUILTIN_TEACHER = BUILTIN_TEACHER / "teacher"


def rollouts(groups: int = 3, n: int = 2) -> RolloutBatch:
    """`groups` prompts of the built-in alphabet, `n` responses each, of different lengths."""
    b = groups * n
    prompts = torch.tensor([[1, 5 + g % 7, 6, 7, 42] for g in range(groups) for _ in range(n)])
    responses = torch.tensor([[8 + i % 9, 9, 10 + i % 5, 2, 0, 0] for i in range(b)])
    mask = (torch.arange(6) < torch.tensor([[4 if i % 2 else 3] for i in range(b)])).long()
    return RolloutBatch(
        prompts=prompts,
        prompt_mask=torch.ones_like(prompts),
        responses=responses * mask,
        response_mask=mask,
        rollout_log_probs=-0.5 * mask.float(),
        uid=[f"p{i // n}" for i in range(b)],
        ground_truth=["x"] * b,
        policy_version=0,
    )


def controller(scorer, support_k: int | None) -> StrictSyncController:
    return StrictSyncController([], scorer, [], None, support_k, 1.0)


@pytest.mark.parametrize("support_k", [None, 0, 5])
def test_the_built_in_teacher_repeats_exactly(support_k):
    """fp32 on the CPU, eval mode: the two scorings are bit-identical (the bound's measured floor, 0.0)."""
    lines = []
    gap = teacher_self_test(
        controller(ScorerWorker(str(BUILTIN_TEACHER), "float32", 4, CPU), support_k), rollouts(), lines.append
    )
    assert gap["sampled_mean"] == 0.0 and gap["support_mean"] == 0.0 and gap["finite"]
    assert gap["tokens"] == 14  # whole prompt groups until >= 4 rows: two groups of 3 + 4 tokens each
    assert "teacher self-test: 4 rows scored twice" in lines[0] and "repeats" in lines[0]


def test_a_teacher_with_dropout_on_is_refused(tmp_path):
    """The built-in teacher with attention dropout 0.1, left in train mode (a teacher loaded without .eval())."""
    leaky = tmp_path / "teacher"
    shutil.copytree(BUILTIN_TEACHER, leaky)
    config = json.loads((leaky / "config.json").read_text())
    (leaky / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    scorer = ScorerWorker(str(leaky), "float32", 4, CPU)
    check_teacher_repeat(teacher_self_test(controller(scorer, 5), rollouts(), lambda *_: None))  # eval: repeats
    scorer.model.train()
    with pytest.raises(ConfigError, match=r"scored the same 14 sampled tokens twice and disagreed .*\(model\.eval\(\)"):
        teacher_self_test(controller(scorer, 5), rollouts(), lambda *_: None)


class NoisyScorer:
    """A scorer whose scores carry fresh noise on every call (nondeterministic kernels)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def score(self, batch: RolloutBatch, support_k: int | None, temperature: float = 1.0) -> TeacherScores:
        b, tr = batch.responses.shape
        noise = self.scale * torch.randn(b, tr)
        return TeacherScores((-1.0 + noise) * batch.response_mask)


def test_a_noisy_scorer_is_refused_and_one_within_the_bound_passes():
    teacher_self_test(controller(NoisyScorer(TEACHER_REPEAT_BOUND / 10), None), rollouts(), lambda *_: None)
    with pytest.raises(ConfigError, match="disagreed with itself by mean .* deterministic kernels"):
        teacher_self_test(controller(NoisyScorer(0.05), None), rollouts(), lambda *_: None)


def test_repeat_gap_closed_form_and_non_finite_scores():
    mask = torch.tensor([[1, 1, 0]])
    a = TeacherScores(torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[[-0.1, -3.0]] * 3]), torch.zeros(1, 3, 2).int())
    b = TeacherScores(
        torch.tensor([[-1.5, -2.0, -9.0]]), torch.tensor([[[-0.1, -2.0]] * 3]), torch.zeros(1, 3, 2).int()
    )
    gap = teacher_repeat_gap(a, b, mask)  # the masked-out third token differs by 9 and is not counted
    assert gap["sampled_mean"] == pytest.approx(0.25) and gap["sampled_max"] == pytest.approx(0.5)
    assert gap["support_mean"] == pytest.approx(0.5) and gap["tokens"] == 2 and gap["finite"]
    nan = TeacherScores(torch.tensor([[float("nan"), -2.0, 0.0]]))
    with pytest.raises(ConfigError, match="not finite .* float16"):
        check_teacher_repeat(teacher_repeat_gap(nan, nan, mask))
