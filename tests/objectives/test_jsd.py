"""Generalized JSD (direct GKD): closed forms on hand-made distributions, endpoints, the top-k tail."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.objectives import generalized_jsd, topk_generalized_jsd
from miniverl.objectives.gkd import jsd_from_logprobs

LN2, LN3 = math.log(2.0), math.log(3.0)

# Teacher p and student q over V = 4 tokens, chosen so that KL(p||q) != KL(q||p) (a swapped argument
# order cannot pass). Logits are log-probabilities, so softmax gives them back exactly.
P = [1 / 2, 1 / 6, 1 / 6, 1 / 6]
Q = [1 / 4, 1 / 4, 1 / 4, 1 / 4]
# KL(p||q) = 1/2 ln(2) + 3 * 1/6 ln(2/3)        = 1/2 ln(4/3)
FORWARD = 0.5 * math.log(4 / 3)
# KL(q||p) = 1/4 ln(1/2) + 3 * 1/4 ln(3/2)      = 3/4 ln 3 - ln 2
REVERSE = 0.75 * LN3 - LN2
# beta = 1/2: m = (p + q)/2 = [3/8, 5/24, 5/24, 5/24]
#   KL(p||m) = 1/2 ln(4/3) + 1/2 ln(4/5) = 1/2 ln(16/15)
#   KL(q||m) = 1/4 ln(2/3) + 3/4 ln(6/5)
#   JSD      = 1/2 KL(p||m) + 1/2 KL(q||m)
HALF = 0.25 * math.log(16 / 15) + 0.125 * math.log(2 / 3) + 0.375 * math.log(6 / 5)


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().view(1, 1, -1)  # [1, 1, V]


def _reference_jsd(p: list[float], q: list[float], beta: float) -> float:
    """Plain-Python definition: beta KL(p||m) + (1 - beta) KL(q||m), m = beta p + (1 - beta) q."""
    m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
    kl_pm = sum(a * math.log(a / c) for a, c in zip(p, m) if a > 0)
    kl_qm = sum(b * math.log(b / c) for b, c in zip(q, m) if b > 0)
    return beta * kl_pm + (1 - beta) * kl_qm


@pytest.mark.parametrize(("beta", "expected"), [(0.0, FORWARD), (0.5, HALF), (1.0, REVERSE)])
def test_closed_form_values(beta, expected):
    got = generalized_jsd(_logits(Q), _logits(P), beta)
    assert got.shape == (1, 1)
    assert got.item() == pytest.approx(expected, abs=1e-6)


def test_forward_and_reverse_differ_so_the_test_can_see_a_swap():
    assert abs(FORWARD - REVERSE) > 0.01


@pytest.mark.parametrize("beta", [0.1, 0.25, 0.9])
def test_interior_beta_matches_the_definition(beta):
    assert generalized_jsd(_logits(Q), _logits(P), beta).item() == pytest.approx(_reference_jsd(P, Q, beta), abs=1e-6)


def test_mixture_form_vanishes_at_the_endpoints_so_they_are_the_exact_kls():
    """JSD_beta / beta -> KL(p||q) as beta -> 0 and JSD_beta / (1 - beta) -> KL(q||p) as beta -> 1."""
    eps = 1e-4
    near0 = generalized_jsd(_logits(Q), _logits(P), eps).item()
    near1 = generalized_jsd(_logits(Q), _logits(P), 1 - eps).item()
    assert near0 < 1e-3 and near1 < 1e-3  # the mixture form itself tends to 0 ...
    assert near0 / eps == pytest.approx(FORWARD, rel=1e-3)  # ... like beta * KL(p||q)
    assert near1 / eps == pytest.approx(REVERSE, rel=1e-3)  # ... like (1 - beta) * KL(q||p)


def test_temperature_divides_both_logits():
    torch.manual_seed(1)
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    for beta in (0.0, 0.5, 1.0):
        assert torch.allclose(generalized_jsd(s, t, beta, temperature=2.0), generalized_jsd(s / 2, t / 2, beta))
    assert not torch.allclose(generalized_jsd(s, t, 0.5, 2.0), generalized_jsd(s, t, 0.5))


def test_zero_probability_tokens_follow_0_log_0_convention():
    """A teacher with p_i = 0 (logit -inf): forward KL skips that token, and the gradient stays finite."""
    s = torch.tensor([[[0.0, 0.0, 0.0]]], requires_grad=True)
    t = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    fwd = generalized_jsd(s, t, 0.0)  # KL([1/2, 1/2, 0] || [1/3]*3) = ln(3/2)
    assert fwd.item() == pytest.approx(math.log(1.5), abs=1e-6)
    fwd.sum().backward()
    assert torch.isfinite(s.grad).all()
    assert generalized_jsd(s.detach(), t, 1.0).item() == float("inf")  # reverse KL: q puts mass where p has none


def test_gradient_reaches_every_student_logit():
    torch.manual_seed(2)
    s = torch.randn(1, 2, 6, requires_grad=True)
    t = torch.randn(1, 2, 6) * 3
    for beta in (0.0, 0.5, 1.0):
        s.grad = None
        generalized_jsd(s, t, beta).sum().backward()
        assert (s.grad.abs() > 0).all()


# ---------------------------------------------------------------------------------------------------
# Top-k support with one tail bucket.
# Teacher p = [1/2, 1/6, 1/6, 1/6], student q2 = [1/4, 1/4, 1/8, 3/8], support K = 2 ids {0, 1}.
# Coarsened to K + 1 = 3 outcomes: p' = [1/2, 1/6, 1/3] (tail 1/6 + 1/6), q' = [1/4, 1/4, 1/2].
Q2 = [1 / 4, 1 / 4, 1 / 8, 3 / 8]
# KL(p'||q') = 1/2 ln 2 + 1/6 ln(2/3) + 1/3 ln(2/3)           = 1/2 ln(4/3)
TAIL_FORWARD = 0.5 * math.log(4 / 3)
# KL(q'||p') = 1/4 ln(1/2) + 1/4 ln(3/2) + 1/2 ln(3/2)        = 3/4 ln 3 - ln 2
TAIL_REVERSE = 0.75 * LN3 - LN2
# beta = 1/2: m' = [3/8, 5/24, 5/12]
#   KL(p'||m') = 1/2 ln(4/3) + 1/6 ln(4/5) + 1/3 ln(4/5)      = 1/2 ln(16/15)
#   KL(q'||m') = 1/4 ln(2/3) + 1/4 ln(6/5) + 1/2 ln(6/5)
TAIL_HALF = 0.25 * math.log(16 / 15) + 0.125 * math.log(2 / 3) + 0.375 * math.log(6 / 5)


def _topk(p: list[float], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k log-probs, ids and the exact tail log-mass, as the scorer ships them. Shapes: [1, 1, K], [1, 1]."""
    lp = torch.tensor([p[i] for i in ids], dtype=torch.float64).log().view(1, 1, -1)
    tail = math.log(sum(x for i, x in enumerate(p) if i not in ids)) if len(ids) < len(p) else float("-inf")
    return lp, torch.tensor(ids).view(1, 1, -1), torch.tensor([[tail]], dtype=torch.float64)


@pytest.mark.parametrize(("beta", "expected"), [(0.0, TAIL_FORWARD), (0.5, TAIL_HALF), (1.0, TAIL_REVERSE)])
def test_tail_bucket_closed_form(beta, expected):
    lp, ids, tail = _topk(P, [0, 1])
    shipped = topk_generalized_jsd(_logits(Q2), lp, ids, beta, teacher_tail_logprob=tail)
    derived = topk_generalized_jsd(_logits(Q2), lp, ids, beta)  # tail = 1 - sum of top-k probabilities
    assert shipped.item() == pytest.approx(expected, abs=1e-6)
    assert derived.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_tail_bucket_is_a_strict_lower_bound_here(beta):
    """Coarsening can only lose divergence (data processing); here q is not proportional to p in the tail."""
    lp, ids, tail = _topk(P, [0, 1])
    coarse = topk_generalized_jsd(_logits(Q2), lp, ids, beta, teacher_tail_logprob=tail).item()
    full = generalized_jsd(_logits(Q2), _logits(P), beta).item()
    assert coarse < full - 1e-3


def test_tail_bucket_is_exact_when_student_and_teacher_are_proportional_in_the_tail():
    """With q uniform and p uniform on the tail ids the likelihood ratio is constant there: no loss."""
    lp, ids, tail = _topk(P, [0, 1])
    for beta in (0.0, 0.5, 1.0):
        coarse = topk_generalized_jsd(_logits(Q), lp, ids, beta, teacher_tail_logprob=tail)
        assert coarse.item() == pytest.approx(generalized_jsd(_logits(Q), _logits(P), beta).item(), abs=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_converges_to_full_as_k_grows_to_v(beta):
    """Nested supports refine the partition, so the value is non-decreasing in K, below the full
    divergence, and equal to it at K = V - 1 (the tail is one token) and K = V (no tail bucket)."""
    torch.manual_seed(3)
    v = 12
    student = torch.randn(2, 3, v, dtype=torch.float64)
    teacher_logp = torch.log_softmax(torch.randn(2, 3, v, dtype=torch.float64) * 2.5, dim=-1)
    full = generalized_jsd(student, teacher_logp, beta)  # [2, 3]
    order = teacher_logp.argsort(dim=-1, descending=True)
    previous = torch.zeros_like(full)
    for k in range(1, v + 1):
        ids = order[..., :k]
        lp = teacher_logp.gather(-1, ids)
        tail = torch.logsumexp(teacher_logp.scatter(-1, ids, float("-inf")), dim=-1)
        got = topk_generalized_jsd(student, lp, ids, beta, teacher_tail_logprob=tail)
        assert (got >= previous - 1e-9).all(), f"K={k} decreased"
        assert (got <= full + 1e-9).all(), f"K={k} exceeds the full divergence"
        previous = got
        if k >= v - 1:
            torch.testing.assert_close(got, full, atol=1e-9, rtol=0)
    assert (previous - topk_generalized_jsd(student, *_first_k(teacher_logp, order, 1), beta)).min() > 0


def _first_k(teacher_logp, order, k):
    ids = order[..., :k]
    return teacher_logp.gather(-1, ids), ids


def test_topk_gradient_reaches_the_tail_logits():
    s = _logits(Q2).clone().requires_grad_(True)
    lp, ids, tail = _topk(P, [0, 1])
    topk_generalized_jsd(s, lp, ids, 1.0, teacher_tail_logprob=tail).sum().backward()
    assert (s.grad.abs() > 0).all()


def test_topk_temperature_applies_to_the_student_only():
    """The teacher's top-k log-probs arrive at the loss temperature; the student's logits are divided here."""
    torch.manual_seed(4)
    s, t = torch.randn(1, 2, 7, dtype=torch.float64), torch.randn(1, 2, 7, dtype=torch.float64)
    t_lp = torch.log_softmax(t / 2.0, dim=-1)
    ids = t_lp.argsort(dim=-1, descending=True)  # K = V
    got = topk_generalized_jsd(s, t_lp.gather(-1, ids), ids, 0.5, temperature=2.0)
    torch.testing.assert_close(got, generalized_jsd(s, t, 0.5, temperature=2.0))


# ---------------------------------------------------------------------------------------------------
# Bad inputs fail with a message that says what is wrong.


@pytest.mark.parametrize("beta", [-0.1, 1.5])
def test_beta_outside_unit_interval_is_rejected(beta):
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(_logits(Q), _logits(P), beta)
    lp, ids, _ = _topk(P, [0, 1])
    with pytest.raises(ValueError, match="beta must be in"):
        topk_generalized_jsd(_logits(Q), lp, ids, beta)


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="shapes must match"):
        generalized_jsd(torch.zeros(1, 2, 4), torch.zeros(1, 2, 5), 0.5)
    with pytest.raises(ValueError, match="shapes must match"):
        topk_generalized_jsd(torch.zeros(1, 2, 4), torch.zeros(1, 2, 2), torch.zeros(1, 2, 3, dtype=torch.long), 0.5)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        topk_generalized_jsd(torch.zeros(1, 3, 4), torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long), 0.5)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        topk_generalized_jsd(torch.zeros(1, 2, 4), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5, dtype=torch.long), 0.5)
    with pytest.raises(ValueError, match="shapes must match"):
        jsd_from_logprobs(torch.zeros(2, 3), torch.zeros(2, 4), 0.5)


def test_non_positive_temperature_is_rejected():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generalized_jsd(_logits(Q), _logits(P), 0.5, temperature=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_equal_distributions_give_exactly_zero_and_no_gradient(beta):
    """The divergence of bitwise-equal distributions is 0 with gradient 0 (computed as written, the mixture's log
    rounds and leaves a residue that Adam scales up: docs/objectives.md, "A zero signal")."""
    torch.manual_seed(0)
    logits = (torch.randn(4, 6, 43) * 4).requires_grad_()  # fp32, as in the learner
    t = torch.log_softmax(logits.detach(), dim=-1)  # the teacher: the same model, the same arithmetic
    jsd = jsd_from_logprobs(t, torch.log_softmax(logits, dim=-1), beta)
    jsd.sum().backward()
    assert torch.equal(jsd, torch.zeros_like(jsd))
    assert torch.equal(logits.grad, torch.zeros_like(logits.grad))


def test_the_signal_floor_zeroes_rounding_and_keeps_a_real_difference():
    torch.manual_seed(0)
    t = torch.log_softmax(torch.randn(2, 3, 8), dim=-1)
    rounding = t + 2e-6 * torch.randn_like(t)  # a few fp32 ulps of the normalizer
    logits = rounding.clone().requires_grad_()
    jsd_from_logprobs(t, torch.log_softmax(logits, dim=-1), 0.5, signal_floor=1e-5).sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits.grad))
    moved = t.clone()
    moved[0, 0] = torch.log_softmax(t[0, 0] + torch.linspace(0, 1e-3, 8), dim=-1)  # one token really differs
    logits = moved.clone().requires_grad_()
    jsd = jsd_from_logprobs(t, torch.log_softmax(logits, dim=-1), 0.5, signal_floor=1e-5)
    jsd.sum().backward()
    assert jsd[0, 0] > 0 and logits.grad[0, 0].abs().max() > 0
    assert torch.equal(logits.grad[1:], torch.zeros_like(logits.grad[1:]))  # the rest agree exactly


def test_topk_paths_apply_the_signal_floor_to_the_tail_too():
    """Top-K + tail: the K + 1 log-probs agreeing within the floor give 0; a tail that differs keeps the term."""
    torch.manual_seed(0)
    student = torch.randn(1, 2, 10, dtype=torch.float64)
    s = torch.log_softmax(student, dim=-1)
    lp, ids = s.topk(3, dim=-1)
    tail = torch.logsumexp(s.scatter(-1, ids, float("-inf")), dim=-1)
    same = topk_generalized_jsd(student, lp + 1e-7, ids, 0.5, teacher_tail_logprob=tail, signal_floor=1e-5)
    assert torch.equal(same, torch.zeros_like(same))
    other = topk_generalized_jsd(student, lp, ids, 0.5, teacher_tail_logprob=tail - 0.1, signal_floor=1e-5)
    assert (other > 0).all()


def test_a_negative_signal_floor_is_rejected():
    t = torch.log_softmax(torch.randn(1, 1, 4), dim=-1)
    with pytest.raises(ValueError, match="signal_floor"):
        jsd_from_logprobs(t, t, 0.5, signal_floor=-1.0)
