"""The training objectives inside LearnerWorker.update: the loss and the gradient do not change with the
micro-batch split, the amount of prompt left-padding / response right-padding, or the order of groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miniverl.batches import PromptBatch, RolloutBatch, TeacherScores
from miniverl.models.lora import LoraSettings
from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.pg_k1 import PgK1Objective
from miniverl.process import ProcessSettings
from miniverl.rollout.sampling import SamplingParams
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "up_proj"), init_seed=0)
CPU = ProcessSettings("cpu", torch_threads=1)
N = 2  # samples per prompt
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # fixed task rewards: GRPO sees every case


def objectives():
    return {
        "gkd_full": GkdObjective(beta=0.5, loss_temperature=1.0, teacher_topk=0),
        "gkd_top8": GkdObjective(beta=0.5, loss_temperature=1.5, teacher_topk=8),
        # Every PG-k1 term on: discounted k1 return, k3 reference penalty, GRPO task reward.
        "pg_k1": PgK1Objective(discount=0.5, is_cap=2.0, kl_coef=0.1, kl_kind="k3", reward_coef=1.0),
    }


@pytest.fixture(scope="module")
def data(student_dir, random_model_dir):
    return on_policy_batch(student_dir, random_model_dir)


def on_policy_batch(student_dir, random_model_dir):
    """One on-policy batch (4 prompts x 2 samples) from the fresh adapter, and a scorer. The teacher is the
    untrained model: any teacher that differs from the student serves, and it is the cheapest to build."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    texts = [("ab>", "ba"), ("dcb>", "bcd"), ("xy>", "yx"), ("pqr>", "rqp")]
    prompts = PromptBatch([tok(p)["input_ids"] for p, _ in texts], [f"u{i}" for i in range(4)], [a for _, a in texts])
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    learner = make_learner(student_dir, objectives()["pg_k1"], 8)
    rollout.load_policy(learner.publish_policy())
    params = SamplingParams(n=N, max_new_tokens=5, temperature=1.0, stop_token_ids=(tok.eos_token_id,), seed=7)
    batch = rollout.generate(prompts, params)
    assert batch.response_mask.sum(1).unique().numel() > 1, "want rows of different lengths (real right padding)"
    return batch, ScorerWorker(str(random_model_dir), "float32", 4, CPU)


LEARNER_LR = 1e-2


def make_learner(student_dir, objective, micro_batch_size: int) -> LearnerWorker:
    torch.manual_seed(0)
    return LearnerWorker(str(student_dir), LORA, "float32", objective, LEARNER_LR, 0.0, 1e9, micro_batch_size, CPU)


def capture_gradients(learner: LearnerWorker) -> list[list[torch.Tensor]]:
    """A list that receives a copy of the adapter's gradients at every optimizer step from now on."""
    grads: list[list[torch.Tensor]] = []
    step = learner.optimizer.step

    def capture(*args, **kwargs):
        grads.append([p.grad.detach().clone() for p in learner.params])
        return step(*args, **kwargs)

    learner.optimizer.step = capture
    return grads


def two_updates(learner: LearnerWorker, batch: RolloutBatch, scores: TeacherScores, rewards=REWARDS):
    """Two optimizer steps on the batch (the second is off-policy, so importance ratios differ from 1);
    returns the metrics and the gradients of each step and the parameters after both."""
    grads = capture_gradients(learner)
    metrics = []
    for version in range(2):
        learner.publish_policy()
        metrics.append(learner.update(dataclasses.replace(batch, policy_version=version), scores, rewards))
    return metrics, grads, [p.detach().clone() for p in learner.params]


def assert_same(a, b, rtol: float, atol: float) -> None:
    (m_a, g_a, p_a), (m_b, g_b, p_b) = a, b
    for step_a, step_b in zip(m_a, m_b):
        for key in ("loss", "clipped_ratio_frac", "ratio_mean", "sampler_gap_mean", "response_tokens"):
            assert step_a[key] == pytest.approx(step_b[key], rel=rtol, abs=atol), key
    assert m_a[1]["ratio_mean"] != pytest.approx(1.0, abs=1e-4)  # the second step really is off-policy
    for ga, gb in zip(g_a, g_b):
        assert max(g.abs().max().item() for g in ga) > 0
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
    # Adam divides by sqrt(v): where a gradient is near Adam's eps, a 1e-5 difference in it moves the step by a
    # share of the whole step (lr). Measured after the built-in models became fp16 values: 3.6e-5 on one entry of
    # gkd_full's split run (0.4% of a step). Bound: 1% of one step, besides the gradients' own 1e-5 check above.
    for x, y in zip(p_a, p_b):
        torch.testing.assert_close(x, y, rtol=10 * rtol, atol=max(10 * atol, LEARNER_LR * 1e-2))


def score(scorer: ScorerWorker, objective, batch: RolloutBatch) -> TeacherScores:
    return scorer.score(batch, objective.teacher_support_k, objective.loss_temperature)


@pytest.mark.parametrize("name", ["gkd_full", "gkd_top8", "pg_k1"])
def test_micro_batch_split_changes_nothing(name, data, student_dir):
    batch, scorer = data
    objective = objectives()[name]
    scores = score(scorer, objective, batch)
    whole = two_updates(make_learner(student_dir, objective, 8), batch, scores)
    split = two_updates(make_learner(student_dir, objective, 2), batch, scores)  # 4 micro-batches
    assert_same(whole, split, rtol=1e-5, atol=1e-6)


def test_the_update_reports_its_own_split(data, student_dir):
    """time/update/{prepare,gradients,checks,optimizer}: the learner's marks in order, so the four parts are
    non-negative and add up to the update's window on its clock (peers.md run 8: the update is the step's largest
    phase at realistic shapes, and no metric said where in it the time went)."""
    from miniverl.workers.learner import UPDATE_PARTS, update_split

    assert update_split(1.0, 1.5, 4.0, 4.25, 5.0) == {
        "time/update/prepare": 0.5,
        "time/update/gradients": 2.5,
        "time/update/checks": 0.25,
        "time/update/optimizer": 0.75,
    }
    batch, scorer = data
    objective = objectives()["pg_k1"]
    learner = make_learner(student_dir, objective, 2)
    metrics, _, _ = two_updates(learner, batch, score(scorer, objective, batch))
    parts = [metrics[-1][f"time/update/{part}"] for part in UPDATE_PARTS]
    assert min(parts) >= 0 and parts[1] > 0  # four micro-batches' forwards and backwards take time
    assert sum(parts) == pytest.approx(learner.window[1] - learner.window[0], abs=1e-6)


def pad(batch: RolloutBatch, left: int, right: int) -> RolloutBatch:
    """Extra prompt left-padding and response right-padding (all masked out)."""

    def cols(t: torch.Tensor, n: int) -> torch.Tensor:
        return torch.zeros((t.shape[0], n), dtype=t.dtype)

    return dataclasses.replace(
        batch,
        prompts=torch.cat([cols(batch.prompts, left), batch.prompts], 1),
        prompt_mask=torch.cat([cols(batch.prompt_mask, left), batch.prompt_mask], 1),
        responses=torch.cat([batch.responses, cols(batch.responses, right)], 1),
        response_mask=torch.cat([batch.response_mask, cols(batch.response_mask, right)], 1),
        rollout_log_probs=torch.cat([batch.rollout_log_probs, cols(batch.rollout_log_probs, right)], 1),
    )


@pytest.mark.parametrize("name", ["gkd_full", "gkd_top8", "pg_k1"])
def test_padding_amounts_change_nothing(name, data, student_dir):
    batch, scorer = data
    objective = objectives()[name]
    padded = pad(batch, left=3, right=2)
    base = two_updates(make_learner(student_dir, objective, 4), batch, score(scorer, objective, batch))
    more = two_updates(make_learner(student_dir, objective, 4), padded, score(scorer, objective, padded))
    # fp32 attention over longer (masked) rows sums in a different order: agreement to ~1e-6, not bitwise.
    assert_same(base, more, rtol=1e-4, atol=1e-6)


def test_group_order_permutes_advantages_and_keeps_the_loss(data, student_dir):
    batch, scorer = data
    objective = objectives()["pg_k1"]
    order = [3, 1, 0, 2]  # new group order; rows of a group stay adjacent
    rows = torch.tensor([g * N + i for g in order for i in range(N)])
    permuted = batch.select(rows.tolist())
    scores, p_scores = score(scorer, objective, batch), score(scorer, objective, permuted)
    learner = make_learner(student_dir, objective, 8)
    ref = learner._reference_logprobs(batch)
    adv = objective.prepare(batch, scores, REWARDS, ref)
    p_adv = objective.prepare(permuted, p_scores, REWARDS[rows], learner._reference_logprobs(permuted))
    torch.testing.assert_close(p_adv, adv[rows], rtol=1e-5, atol=1e-6)
    assert (adv.abs() > 0).any()

    base = two_updates(make_learner(student_dir, objective, 8), batch, scores)
    moved = two_updates(make_learner(student_dir, objective, 8), permuted, p_scores, REWARDS[rows])
    assert_same(base, moved, rtol=1e-5, atol=1e-6)


def one_update(learner: LearnerWorker, batch: RolloutBatch, scores: TeacherScores, rewards, num_step_tokens=None):
    """One on-policy step: its loss and the adapter's gradient."""
    grads = capture_gradients(learner)
    learner.publish_policy()
    loss = learner.update(batch, scores, rewards, num_step_tokens)["loss"]
    return loss, grads[0]


@pytest.mark.parametrize("name", ["gkd_top8", "pg_k1"])
def test_loss_weight_by_source_scales_exactly_its_rows(name, data, student_dir):
    """trainer.loss_weight_by_source: weight w on source "a" adds (w - 1) x the a rows' share of the step loss (their
    own update with the whole step's token count), to the loss and to the gradient; no weights, or weights of
    sources the batch lacks, leave both bit for bit as they were."""
    batch, scorer = data
    batch = dataclasses.replace(batch, data_source=["a"] * 4 + ["b"] * 4)  # groups 0-1 source a, 2-3 source b
    objective = objectives()[name]
    scores = score(scorer, objective, batch)
    plain = one_update(make_learner(student_dir, objective, 2), batch, scores, REWARDS)
    absent = make_learner(student_dir, objective, 2)
    absent.loss_weight_by_source = {"c": 3.0}
    assert one_update(absent, batch, scores, REWARDS)[0] == plain[0]
    rows = [0, 1, 2, 3]
    tokens = int(batch.response_mask.sum())
    part = one_update(
        make_learner(student_dir, objective, 2), batch.select(rows), scorer_rows(scores, rows), REWARDS[:4], tokens
    )
    weighted = make_learner(student_dir, objective, 2)
    weighted.loss_weight_by_source = {"a": 3.0}
    loss, grads = one_update(weighted, batch, scores, REWARDS)
    assert abs(part[0]) > 1e-4
    assert loss == pytest.approx(plain[0] + 2 * part[0], rel=1e-5)
    for g, g_plain, g_part in zip(grads, plain[1], part[1]):
        torch.testing.assert_close(g, g_plain + 2 * g_part, rtol=1e-4, atol=1e-6)


def scorer_rows(scores: TeacherScores, rows: list[int]) -> TeacherScores:
    from miniverl.workers.teachers import take_scores

    return take_scores(scores, torch.tensor(rows))
