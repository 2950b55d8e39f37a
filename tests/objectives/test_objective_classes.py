"""GkdObjective and PgK1Objective as the learner calls them (prepare once, loss per micro-batch), and the
registry that picks them by name."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miniverl.batches import RolloutBatch, TeacherScores
from miniverl.config import GkdObjectiveConfig, ObjectiveConfig, PgK1ObjectiveConfig
from miniverl.errors import ConfigError
from miniverl.models.logprobs import response_logits, token_logprobs
from miniverl.objectives import OBJECTIVES, build_objective, generalized_jsd, grpo_advantages, kl_penalty
from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.pg_k1 import PgK1Objective
from miniverl.process import ProcessSettings
from miniverl.workers.scorer import ScorerWorker

B, T, V = 2, 3, 6
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _batch(rollout_log_probs: torch.Tensor, uid=("a", "a")) -> SimpleNamespace:
    return SimpleNamespace(response_mask=MASK, rollout_log_probs=rollout_log_probs * MASK, uid=list(uid))


def _teacher(temperature: float = 1.0) -> torch.Tensor:
    torch.manual_seed(5)
    return torch.log_softmax(torch.randn(B, T, V) * 2 / temperature, dim=-1)  # [B, T, V]


def test_gkd_full_support_and_top_k_at_k_equal_v_give_the_same_loss():
    torch.manual_seed(6)
    logits = torch.randn(B, T, V, requires_grad=True)
    lp = token_logprobs(logits, torch.zeros(B, T, dtype=torch.long))
    teacher = _teacher()
    ids = teacher.argsort(dim=-1, descending=True)  # K = V, teacher's order
    full = TeacherScores(torch.zeros(B, T), teacher_topk_logprobs=teacher)
    top = TeacherScores(torch.zeros(B, T), teacher_topk_logprobs=teacher.gather(-1, ids), teacher_topk_ids=ids)
    short_ids = ids[..., :2]
    short = TeacherScores(
        torch.zeros(B, T),
        teacher_topk_logprobs=teacher.gather(-1, short_ids),
        teacher_topk_ids=short_ids,
        teacher_tail_logprob=torch.logsumexp(teacher.scatter(-1, short_ids, float("-inf")), dim=-1),
    )
    for beta in (0.0, 0.5, 1.0):
        objective = GkdObjective(beta=beta, loss_temperature=1.0, teacher_topk=0)
        batch = _batch(lp.detach())
        loss_full, m_full = objective.loss(logits, lp, batch, full, None, num_step_tokens=5)
        loss_top, m_top = objective.loss(logits, lp, batch, top, None, num_step_tokens=5)
        loss_short, _ = objective.loss(logits, lp, batch, short, None, num_step_tokens=5)
        assert loss_full.item() == pytest.approx(loss_top.item(), abs=1e-6)
        assert loss_short.item() < loss_full.item() - 1e-3  # K = 2 < V: the tail bucket is a lower bound
        want = (generalized_jsd(logits, teacher, beta) * MASK).sum() / 5  # the step has 5 response tokens
        assert loss_full.item() == pytest.approx(want.item(), abs=1e-6)
        assert m_full["jsd"].item() == pytest.approx(m_top["jsd"].item(), abs=1e-6)
        (g_full,) = torch.autograd.grad(loss_full, logits)
        (g_top,) = torch.autograd.grad(loss_top, logits)
        torch.testing.assert_close(g_full, g_top)


def test_gkd_reports_clipped_ratio_fraction_like_pg_k1():
    """Learner/sampler ratios [[3, 1, 2.5], [1, 0.2, (masked 9)]] -> 2 of 5 tokens above the default cap 2."""
    logits = torch.zeros(B, T, V)
    lp = torch.full((B, T), -math.log(V))
    ratios = torch.tensor([[3.0, 1.0, 2.5], [1.0, 0.2, 9.0]])
    batch = _batch(lp - ratios.log())
    scores = TeacherScores(torch.zeros(B, T), teacher_topk_logprobs=_teacher())
    _, gkd = GkdObjective(1.0, 1.0, 0).loss(logits, lp, batch, scores, None, 5)
    _, pg = PgK1Objective(0.0, 2.0, 0.0, "k1", 0.0).loss(logits, lp, batch, scores, torch.zeros(B, T), 5)
    assert gkd["clipped_ratio_frac"].item() == pytest.approx(2 / 5)
    assert pg["clipped_ratio_frac"].item() == pytest.approx(2 / 5)


def test_gkd_loss_temperature_is_the_scorers_and_independent_of_sampling(student_dir, random_model_dir):
    """Scorer at loss temperature 2 + GkdObjective(loss_temperature=2) = generalized_jsd at temperature 2
    of the two models' logits. The sampler's log-probs (any sampling temperature) do not enter the loss."""
    from transformers import AutoModelForCausalLM

    prompts = torch.tensor([[0, 1, 5, 6], [1, 7, 8, 9]])
    responses = torch.tensor([[10, 11, 2], [12, 2, 0]])
    batch = RolloutBatch(
        prompts=prompts,
        prompt_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
        responses=responses,
        response_mask=MASK.clone(),
        rollout_log_probs=-torch.ones(B, T) * MASK,
        uid=["a", "b"],
        ground_truth=["", ""],
        policy_version=0,
    )
    scorer = ScorerWorker(str(random_model_dir), "float32", 4, ProcessSettings("cpu", torch_threads=1))
    student = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    logits = response_logits(student, batch).detach()
    teacher_logits = response_logits(scorer.model, batch)
    objective = GkdObjective(beta=0.5, loss_temperature=2.0, teacher_topk=0)
    scores = scorer.score(batch, objective.teacher_support_k, objective.loss_temperature)
    lp = token_logprobs(logits, responses)
    loss, _ = objective.loss(logits, lp, batch, scores, None, num_step_tokens=5)
    want = (generalized_jsd(logits, teacher_logits, 0.5, temperature=2.0) * MASK).sum() / 5
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    at_one = (generalized_jsd(logits, teacher_logits, 0.5, temperature=1.0) * MASK).sum() / 5
    assert abs(at_one.item() - want.item()) > 1e-3  # the temperature really matters here
    resampled = RolloutBatch(**{**batch.__dict__, "rollout_log_probs": -3 * torch.ones(B, T) * MASK})
    assert objective.loss(logits, lp, resampled, scores, None, 5)[0].item() == loss.item()
    with pytest.raises(ValueError, match="temperature"):  # support scored at another temperature
        GkdObjective(0.5, 1.0, 0).loss(logits, lp, batch, scores, None, 5)


def test_pg_k1_prepare_mixes_k1_reference_penalty_and_grpo():
    """A_t = (log p - log q_old) - kl_coef * k1(q_old, ref) + reward_coef * grpo(score), on the mask."""
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, 0.0]])
    teacher = torch.tensor([[-0.5, -3.0, -2.0], [-0.2, -0.1, 0.0]])
    ref = torch.tensor([[-1.5, -0.5, -1.0], [-0.4, -1.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0])
    batch = _batch(old)
    scores = SimpleNamespace(teacher_log_probs=teacher * MASK)
    objective = PgK1Objective(discount=0.0, is_cap=2.0, kl_coef=0.25, kl_kind="k1", reward_coef=0.5)
    assert objective.needs_reference
    adv = objective.prepare(batch, scores, rewards, ref * MASK)
    grpo = grpo_advantages(rewards, ["a", "a"])  # mean 1/2, unbiased std sqrt(1/2): +-(1/2) / sqrt(1/2)
    want = ((teacher - old) - 0.25 * kl_penalty(old, ref, "k1") + 0.5 * grpo[:, None]) * MASK
    torch.testing.assert_close(adv, want)
    # Row 0, token 0: (-0.5 + 1) - 0.25 * (-1 + 1.5) + 0.5 * 0.5 / (sqrt(0.5) + 1e-6) = 0.72855
    assert adv[0, 0].item() == pytest.approx(0.5 - 0.25 * 0.5 + 0.5 * 0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-6)
    assert not PgK1Objective(0.0, 2.0, 0.0, "k1", 0.0).needs_reference
    with pytest.raises(ValueError, match="needs task rewards"):
        objective.prepare(batch, scores, None, ref)
    with pytest.raises(ValueError, match="reference log-probs"):
        objective.prepare(batch, scores, rewards, None)


def test_objectives_are_chosen_by_name():
    gkd = build_objective(GkdObjectiveConfig(beta=0.2, loss_temperature=0.7, teacher_topk=16))
    assert isinstance(gkd, GkdObjective)
    assert (gkd.beta, gkd.loss_temperature, gkd.teacher_support_k) == (0.2, 0.7, 16)
    pg = build_objective(PgK1ObjectiveConfig(discount=0.9, kl_coef=0.1, kl_kind="low_var_kl"))
    assert isinstance(pg, PgK1Objective) and pg.teacher_support_k is None and pg.needs_reference
    assert OBJECTIVES.names() == ["gkd", "pg_k1"]
    with pytest.raises(ConfigError, match="unknown objective 'ppo'; known: gkd, pg_k1"):
        build_objective(ObjectiveConfig(name="ppo"))


def test_bad_objective_settings_are_rejected():
    with pytest.raises(ValueError, match="beta must be in"):
        GkdObjective(beta=1.5, loss_temperature=1.0, teacher_topk=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        GkdObjective(beta=0.5, loss_temperature=0.0, teacher_topk=0)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        PgK1Objective(discount=0.0, is_cap=2.0, kl_coef=0.1, kl_kind="k9", reward_coef=0.0)
    with pytest.raises(ValueError, match="discount"):
        PgK1Objective(discount=2.0, is_cap=2.0, kl_coef=0.0, kl_kind="k1", reward_coef=0.0)
