"""PG-k1: closed-form loss and gradient, truncated importance sampling, discounting, and exact enumeration
on a tiny vocabulary showing that its expected gradient is the gradient of the per-token reverse KL."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from miniverl.objectives import discounted_returns, k1_advantages, pg_k1_loss, topk_generalized_jsd, truncated_pg_loss

LN2 = math.log(2.0)


def test_on_policy_closed_form_value_and_gradient():
    """One row, two tokens, sampler == learner. q = [1/2, 1/4], p = [1/4, 1/4] on the sampled tokens:
    A = log p - log q = [ln(1/2), 0] = [-ln 2, 0]; rho = 1; loss = -(1 * -ln 2 + 1 * 0) / 2 = ln(2) / 2,
    which is also the k1 estimate mean_t(log q - log p) of the reverse KL. d loss / d logq_t = -A_t / 2."""
    lp = torch.tensor([[0.5, 0.25]]).log().requires_grad_(True)
    teacher = torch.tensor([[0.25, 0.25]]).log()
    mask = torch.ones(1, 2)
    loss, metrics = pg_k1_loss(lp, lp.detach(), teacher, mask)
    assert loss.item() == pytest.approx(LN2 / 2, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[LN2 / 2, 0.0]]))
    assert metrics["clipped_ratio_frac"].item() == 0.0
    assert metrics["advantage_mean"].item() == pytest.approx(-LN2 / 2, abs=1e-7)


def test_truncated_importance_weights_closed_form():
    """Learner/sampler ratios rho = [3, 1/2, 2, 5] with cap 2 -> weights [2, 1/2, 2, 2]; the last token is
    masked out. A = [1, -2, 4, 100]. loss = -(2*1 + 1/2*(-2) + 2*4) / 3 = -3 and
    d loss / d logq = -w A / 3 = [-2/3, 1/3, -8/3, 0]. Clipped: rho > cap on token 0 only -> 1/3."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    lp = (old + torch.tensor([[3.0, 0.5, 2.0, 5.0]]).log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = truncated_pg_loss(lp, old, adv, mask, is_cap=2.0)
    assert loss.item() == pytest.approx(-3.0, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 / 3, 1 / 3, -8 / 3, 0.0]]))
    assert metrics["clipped_ratio_frac"].item() == pytest.approx(1 / 3)  # ratio exactly at the cap is not clipped
    assert metrics["ratio_mean"].item() == pytest.approx((3 + 0.5 + 2) / 3, rel=1e-6)


def test_below_the_cap_the_gradient_is_that_of_rho_times_a():
    """For rho <= cap the surrogate has the value and gradient of rho * A (grad rho = rho grad log q)."""
    torch.manual_seed(0)
    old = -torch.rand(3, 5) * 3
    lp = (old + torch.empty(3, 5).uniform_(-0.6, 0.6)).requires_grad_(True)  # rho in [0.55, 1.8]
    adv, mask = torch.randn(3, 5), torch.ones(3, 5)
    loss, _ = truncated_pg_loss(lp, old, adv, mask, is_cap=2.0)
    (g,) = torch.autograd.grad(loss, lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    plain = -(torch.exp(lp2 - old) * adv).sum() / 15
    (g2,) = torch.autograd.grad(plain, lp2)
    assert loss.item() == pytest.approx(plain.item(), abs=1e-6)
    torch.testing.assert_close(g, g2)


def test_step_token_count_normalizes_the_loss():
    lp = torch.tensor([[-1.0, -1.0]])
    loss, _ = pg_k1_loss(lp, lp, torch.tensor([[-2.0, -3.0]]), torch.ones(1, 2), num_step_tokens=10)
    assert loss.item() == pytest.approx((1 + 2) / 10)  # A = [-1, -2], loss = -sum(A) / 10


def test_discounted_returns_closed_form():
    """r = [1, 2, 4, 8], mask [1, 1, 1, 0], gamma = 1/2: A_2 = 4, A_1 = 2 + 4/2 = 4, A_0 = 1 + 4/2 = 3;
    the masked token neither gets a return nor feeds one. gamma 0 gives A = r on the mask; gamma 1 the
    undiscounted reward-to-go [7, 6, 4, 0]."""
    r = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    torch.testing.assert_close(discounted_returns(r, mask, 0.5), torch.tensor([[3.0, 4.0, 4.0, 0.0]]))
    torch.testing.assert_close(discounted_returns(r, mask, 0.0), torch.tensor([[1.0, 2.0, 4.0, 0.0]]))
    torch.testing.assert_close(discounted_returns(r, mask, 1.0), torch.tensor([[7.0, 6.0, 4.0, 0.0]]))


def test_k1_advantages_are_teacher_minus_old_and_detached():
    teacher = torch.tensor([[-0.5, -4.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -2.0]], requires_grad=True)
    adv = k1_advantages(teacher, old, torch.tensor([[1, 1, 0]]))
    assert not adv.requires_grad
    torch.testing.assert_close(adv, torch.tensor([[0.5, -3.0, 0.0]]))
    torch.testing.assert_close(k1_advantages(teacher, old, torch.ones(1, 3), 1.0), torch.tensor([[-1.5, -2.0, 1.0]]))


def test_the_advantage_and_the_sampler_carry_no_gradient():
    """Even when the sampler's log-probs are the learner's own tensor (same graph) and the teacher's
    log-probs require grad, only `-w A grad log q` flows: nothing reaches teacher or old log-probs, and
    the gradient is exactly that of `-sum_t c_t log q_t` with the constants c = w A / N."""
    theta = torch.randn(2, 3, 5, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3))
    lp = torch.log_softmax(theta, -1).gather(-1, ids[..., None])[..., 0]  # [2, 3]
    teacher = (torch.randn(2, 3) - 2).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _ = pg_k1_loss(lp, lp, teacher, mask, discount=0.5)
    loss.backward(retain_graph=True)
    assert teacher.grad is None
    adv = discounted_returns((teacher - lp).detach() * mask, mask, 0.5)
    expected = torch.autograd.grad(-(adv * mask * lp).sum() / mask.sum(), theta, retain_graph=True)[0]
    torch.testing.assert_close(theta.grad, expected)
    adv_in = torch.randn(2, 3, requires_grad=True)  # an advantage tensor still attached to a graph
    _, g_adv = torch.autograd.grad(truncated_pg_loss(lp, lp, adv_in, mask)[0], (theta, adv_in), allow_unused=True)
    assert g_adv is None


# ---------------------------------------------------------------------------------------------------
# Exact enumeration: a tabular autoregressive student and teacher over V = 3 tokens (token 0 = EOS),
# horizon 3. Every sequence y is enumerated with its probability under q_old (= q_theta in value), so the
# expected PG-k1 gradient is computed without sampling noise and compared with the analytic targets.

V, HORIZON, EOS = 3, 3, 0


def _prefixes() -> list[tuple[int, ...]]:
    """Every non-terminal state: prefixes of length < HORIZON that contain no EOS."""
    return [p for n in range(HORIZON) for p in itertools.product(range(1, V), repeat=n)]


def _sequences() -> list[tuple[int, ...]]:
    """Every complete response: ends at EOS, or runs to HORIZON."""
    out = []
    for n in range(1, HORIZON + 1):
        for seq in itertools.product(range(V), repeat=n):
            if EOS in seq[:-1]:
                continue
            if seq[-1] == EOS or n == HORIZON:
                out.append(seq)
    return out


class Tabular:
    def __init__(self, seed: int, scale: float, requires_grad: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.index = {p: i for i, p in enumerate(_prefixes())}
        self.logits = (torch.randn(len(self.index), V, generator=g, dtype=torch.float64) * scale).requires_grad_(
            requires_grad
        )

    def logp(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [V]
        return torch.log_softmax(self.logits[self.index[prefix]], dim=-1)

    def token_logprobs(self, seq: tuple[int, ...]) -> torch.Tensor:  # [T]
        return torch.stack([self.logp(seq[:t])[seq[t]] for t in range(len(seq))])


def _padded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad one row to HORIZON. Shapes: [T] -> [1, HORIZON], mask [1, HORIZON]."""
    pad = HORIZON - values.shape[0]
    mask = torch.cat([torch.ones(values.shape[0]), torch.zeros(pad)]).to(torch.float64)
    return torch.cat([values, values.new_zeros(pad)]).unsqueeze(0), mask.unsqueeze(0)


def _expected_gradient(student: Tabular, teacher: Tabular, advantage_fn, discount: float = 0.0) -> torch.Tensor:
    """sum_y q_old(y) * grad loss(y), with loss(y) the token-sum surrogate (num_step_tokens = 1)."""
    total = torch.zeros((), dtype=torch.float64)
    for seq in _sequences():
        lp = student.token_logprobs(seq)
        prob = lp.detach().sum().exp()  # q_old(y), a constant weight
        lp_row, mask = _padded(lp)
        old_row = lp_row.detach()
        if advantage_fn is None:
            t_row, _ = _padded(teacher.token_logprobs(seq).detach())
            loss, _ = pg_k1_loss(lp_row, old_row, t_row, mask, discount=discount, num_step_tokens=1)
        else:
            adv, _ = _padded(torch.stack([advantage_fn(seq[:t]) for t in range(len(seq))]))
            loss, _ = truncated_pg_loss(lp_row, old_row, adv, mask, num_step_tokens=1)
        total = total + prob * loss
    (grad,) = torch.autograd.grad(total, student.logits)
    return grad


def _state_probs(student: Tabular) -> dict[tuple[int, ...], torch.Tensor]:
    """P_old(reach prefix s) for every non-terminal state (detached)."""
    out = {(): torch.ones((), dtype=torch.float64)}
    for prefix in _prefixes():
        if prefix:
            parent = prefix[:-1]
            out[prefix] = out[parent] * student.logp(parent)[prefix[-1]].detach().exp()
    return out


def _reverse_kl(student: Tabular, teacher: Tabular, prefix) -> torch.Tensor:
    q, p = student.logp(prefix), teacher.logp(prefix).detach()
    return (q.exp() * (q - p)).sum()


@pytest.fixture
def models() -> tuple[Tabular, Tabular]:
    return Tabular(seed=11, scale=1.0, requires_grad=True), Tabular(seed=12, scale=3.0, requires_grad=False)


def test_expected_pg_k1_gradient_equals_per_token_reverse_kl_gradient(models):
    """Discount 0, on-policy: E_y[grad loss] = grad sum_t E_{s_t ~ q_old}[KL(q_theta(.|s_t) || p(.|s_t))]
    with the state distribution held fixed (it is the sampler's)."""
    student, teacher = models
    got = _expected_gradient(student, teacher, None)
    reach = _state_probs(student)
    target = sum(reach[s] * _reverse_kl(student, teacher, s) for s in _prefixes())
    (want,) = torch.autograd.grad(target, student.logits)
    assert want.abs().max() > 1e-2  # a non-trivial gradient
    assert (got - want).abs().max().item() < 1e-6


def test_discount_one_gives_the_sequence_level_reverse_kl_gradient(models):
    """With discount 1 the reward-to-go estimator's expectation is the full gradient of the sequence KL
    KL(q(y) || p(y)), including the effect of each token on the states that follow."""
    student, teacher = models
    got = _expected_gradient(student, teacher, None, discount=1.0)
    seq_kl = sum(
        (lq := student.token_logprobs(y).sum()).exp() * (lq - teacher.token_logprobs(y).detach().sum())
        for y in _sequences()
    )
    (want,) = torch.autograd.grad(seq_kl, student.logits)
    assert (got - want).abs().max().item() < 1e-6
    per_token = _expected_gradient(student, teacher, None, discount=0.0)
    assert (per_token - want).abs().max().item() > 1e-3  # the two objectives really differ


def test_a_state_only_advantage_has_zero_expected_gradient(models):
    """A_t = f(s_t) (here the top-2 reverse KL at s_t, a tempting but wrong 'advantage') gives
    E[f(s_t) grad log q(y_t|s_t)] = f(s_t) grad sum_y q(y|s_t) = 0, while single samples do move."""
    student, teacher = models
    ids = torch.tensor([[[0, 1]]])

    def state_kl(prefix):
        t = teacher.logp(prefix).detach().view(1, 1, V)
        logits = student.logp(prefix).detach().view(1, 1, V)
        return topk_generalized_jsd(logits, t.gather(-1, ids), ids, 1.0)[0, 0]

    got = _expected_gradient(student, teacher, state_kl)
    assert got.abs().max().item() < 1e-12
    # One sample alone has a clearly non-zero gradient: the zero above is the expectation, not a no-op.
    seq = _sequences()[0]
    lp_row, mask = _padded(student.token_logprobs(seq))
    adv, _ = _padded(torch.stack([state_kl(seq[:t]) for t in range(len(seq))]))
    loss, _ = truncated_pg_loss(lp_row, lp_row.detach(), adv, mask, num_step_tokens=1)
    assert torch.autograd.grad(loss, student.logits)[0].abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------


def test_mismatched_shapes_and_bad_settings_are_rejected():
    a, b = torch.zeros(2, 3), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="shapes must match"):
        pg_k1_loss(a, a, b, a)
    with pytest.raises(ValueError, match="shapes must match"):
        truncated_pg_loss(a, a, a, b)
    with pytest.raises(ValueError, match="shapes must match"):
        discounted_returns(a, b, 0.5)
    with pytest.raises(ValueError, match="discount must be in"):
        pg_k1_loss(a, a, a, torch.ones(2, 3), discount=1.5)
    with pytest.raises(ValueError, match="is_cap must be >= 1"):
        truncated_pg_loss(a, a, a, torch.ones(2, 3), is_cap=0.5)
    with pytest.raises(ValueError, match="no response tokens"):
        pg_k1_loss(a, a, a, torch.zeros(2, 3))


def test_one_version_behind_the_current_policys_advantage_keeps_the_reverse_kl_gradient():
    """Exact enumeration at one state, vocabulary 4: tokens sampled by an older policy q_b, learner q_theta.
    With A = log p - log q_theta (detached: the current policy's log-probs, as the learner passes them for a
    lagging batch) and rho = q_theta / q_b untruncated, E_{y~q_b}[grad loss] is the gradient of
    KL(q_theta || p). With the sampler's log-probs in the advantage (A = log p - log q_b) it is not: the
    one-version policy change would bias every token's signal."""
    theta = torch.tensor([0.3, -0.2, 1.0, -1.0], dtype=torch.float64, requires_grad=True)
    log_b = torch.log_softmax(torch.tensor([0.0, 0.1, 0.8, -0.6], dtype=torch.float64), 0)  # the sampler
    log_p = torch.log_softmax(torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=torch.float64), 0)  # the teacher

    def expected_grad(log_old_for_advantage) -> torch.Tensor:
        lq = torch.log_softmax(theta, 0)
        total = torch.zeros((), dtype=torch.float64)
        for y in range(4):  # E_{y ~ q_b}: weight each sampled token by the sampler's probability
            lp, old, teacher = (t[y].reshape(1, 1) for t in (lq, log_b, log_p))  # [1, 1]
            adv = k1_advantages(teacher, log_old_for_advantage(lq)[y].reshape(1, 1), torch.ones(1, 1))
            loss, _ = truncated_pg_loss(lp, old, adv, torch.ones(1, 1), is_cap=float("inf"))
            total = total + log_b[y].exp() * loss
        (g,) = torch.autograd.grad(total, theta)
        return g

    lq = torch.log_softmax(theta, 0)
    (kl_grad,) = torch.autograd.grad((lq.exp() * (lq - log_p)).sum(), theta)
    torch.testing.assert_close(expected_grad(lambda lq: lq.detach()), kl_grad)
    assert not torch.allclose(expected_grad(lambda lq: log_b), kl_grad, atol=1e-3)


def test_a_k1_reward_within_the_signal_floor_counts_as_zero():
    """Teacher = student: r_t is the sampler's rounding against the teacher (|r_t| ~ 1e-6 nats), which must not
    become a policy gradient; a real r_t (and its discounted return) is kept."""
    teacher = torch.tensor([[-1.0, -2.0, -0.5]])
    old = teacher + torch.tensor([[3e-6, -5e-6, 0.25]])
    mask = torch.ones_like(teacher)
    adv = k1_advantages(teacher, old, mask, discount=0.5, signal_floor=1e-5)
    assert torch.equal(adv[0, :2], torch.tensor([-0.0625, -0.125]))  # only the real -0.25, discounted back
    assert adv[0, 2] == -0.25
    assert k1_advantages(teacher, old, mask)[0, 0] != 0  # floor 0: only an exact 0 is no signal
    with pytest.raises(ValueError, match="signal_floor"):
        k1_advantages(teacher, old, mask, signal_floor=-1e-5)
