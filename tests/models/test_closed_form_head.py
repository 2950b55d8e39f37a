"""The fused LM head's closed-form gradient (models/fused_head.py) equals autograd's (both in fp32, as the head
computes) over the same losses: the
sampled token's log-prob alone (PG-k1) and a top-K support with its tail bucket (GKD), with the sampled id
inside and outside the support, at a tiny tail mass, and at chunk sizes that split the tokens unevenly."""

from __future__ import annotations

import pytest
import torch

from miniverl.models.fused_head import Support, fused_head_loss
from miniverl.objectives.gkd import GkdObjective, support_jsd, topk_generalized_jsd
from miniverl.objectives.pg_k1 import PgK1Objective

N, H, V, K = 7, 6, 40, 5


def _head(seed: int, dtype=torch.float32) -> torch.nn.Linear:
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False).to(dtype)
    head.weight.requires_grad_(False)
    return head


def _inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    ids = torch.randint(0, V, (N,), generator=g)
    support = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])  # [N, K] distinct per row
    support[0, 2] = ids[0]  # the sampled id inside the support on one row
    teacher = torch.log_softmax(torch.randn(N, K + 1, generator=g, dtype=dtype), -1)[:, :K]  # mass left for a tail
    weights = torch.randn(N, generator=g, dtype=dtype)
    return hidden, ids, support, teacher, weights


def _loss_fn(weights):
    # every per-token input matters: the log-prob (PG-like) and the term (GKD-like), weighted per token
    def loss_fn(logprobs, terms, positions):
        out = weights[positions] * logprobs
        return out if terms is None else out + terms * (1 + weights[positions])

    return loss_fn


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("with_support", [False, True])
def test_closed_form_gradient_equals_autograd(chunk, with_support):
    head = _head(0)
    hidden, ids, support_ids, teacher, weights = _inputs(1)

    def support_terms(sup, tail, positions):
        return support_jsd(sup[None], tail[None], teacher[positions][None], None, 0.5)[0]

    support = Support(support_ids, support_terms) if with_support else None
    h1 = hidden.clone().requires_grad_()
    loss1, lp1, t1 = fused_head_loss(h1, head, ids, chunk, None, _loss_fn(weights), support)
    loss1.backward()
    # reference: plain autograd over the whole [N, V] logits
    h2 = hidden.clone().requires_grad_()
    logits = head(h2)
    lp2 = torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0]
    t2 = topk_generalized_jsd(logits[None], teacher[None], support_ids[None], 0.5)[0] if with_support else None
    loss2 = _loss_fn(weights)(lp2, t2, slice(0, N)).sum()
    loss2.backward()
    torch.testing.assert_close(loss1, loss2)
    torch.testing.assert_close(lp1, lp2.detach())
    if with_support:
        torch.testing.assert_close(t1, t2.detach())
    else:
        assert t1 is None
    torch.testing.assert_close(h1.grad, h2.grad)


def test_tiny_tail_mass_gives_a_finite_exact_gradient():
    # The support holds all but ~1e-40 of the student's mass: the tail's softmax q_j = p_j / P must not be
    # formed as p_j * exp(lse - lse_tail) (that overflows); the gradient stays finite and equal to autograd's.
    head = _head(2)
    hidden, ids, support_ids, teacher, weights = _inputs(3)
    with torch.no_grad():
        bump = torch.zeros(V, H)
        head.weight.copy_(head.weight * 0.01 + bump)
        hidden = hidden * 0.01
        logits_bias = torch.full((N, V), -95.0)  # e^95 overflows fp32
        logits_bias.scatter_(1, support_ids, 0.0)
    head.bias = torch.nn.Parameter(logits_bias[0].clone(), requires_grad=False)
    support_ids = support_ids[:1].expand(N, K).contiguous()  # one support, matching the bias

    def support_terms(sup, tail, positions):
        return support_jsd(sup[None], tail[None], teacher[positions][None], None, 0.9)[0]

    h1 = hidden.clone().requires_grad_()
    loss1, _, _ = fused_head_loss(h1, head, ids, 4, None, _loss_fn(weights), Support(support_ids, support_terms))
    loss1.backward()
    h2 = hidden.clone().requires_grad_()
    logits = head(h2)
    lp = torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0]
    terms = topk_generalized_jsd(logits[None], teacher[None], support_ids[None], 0.9)[0]
    _loss_fn(weights)(lp, terms, slice(0, N)).sum().backward()
    assert torch.isfinite(h1.grad).all()
    torch.testing.assert_close(h1.grad, h2.grad)


def test_terms_from_logits_and_from_a_support_are_exclusive():
    head = _head(0)
    hidden, ids, support_ids, _, weights = _inputs(1)
    with pytest.raises(ValueError, match="not both"):
        fused_head_loss(
            hidden, head, ids, 3, lambda logits, p: logits.sum(-1), _loss_fn(weights), Support(support_ids, None)
        )


def test_gkd_takes_the_closed_form_only_for_a_top_k_support_at_temperature_one():
    class Scores:
        teacher_topk_ids = torch.zeros(1, 2, 3, dtype=torch.int32)
        teacher_topk_logprobs = torch.zeros(1, 2, 3)

    assert GkdObjective(0.5, 1.0, 3).support_ids(Scores()) is Scores.teacher_topk_ids
    assert GkdObjective(0.5, 2.0, 3).support_ids(Scores()) is None  # two normalizers: autograd per chunk
    Scores.teacher_topk_ids = None  # full vocabulary
    assert GkdObjective(0.5, 1.0, 0).support_ids(Scores()) is None
    # the learner's memory model reads the same rule (models/sizing.py): only these take the closed form
    assert GkdObjective(0.5, 1.0, 3).closed_form_head and PgK1Objective(0.0, 2.0, 0.0, "k1", 0.0).closed_form_head
    assert not GkdObjective(0.5, 2.0, 3).closed_form_head and not GkdObjective(0.5, 1.0, 0).closed_form_head
