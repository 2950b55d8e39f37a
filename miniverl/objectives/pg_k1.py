"""PG-k1: policy gradient with the per-token k1 signal `r_t = log p(y_t|s_t) - log q_old(y_t|s_t)`.

This is the on-policy distillation loss of Tinker / MOPD. With discount 0 the advantage is `A_t = r_t`,
and the expected gradient of `-sum_t rho_t A_t` (rho_t = q_theta / q_old, A_t detached) equals the
gradient of the per-token reverse KL(q || p) on the sampled states:
`E_{y~q}[(log q(y) - log p(y)) grad log q(y)] = grad sum_y q(y) (log q(y) - log p(y))` because
`E_{y~q}[grad log q(y)] = 0`. For the same reason the advantage must be this *action-dependent*
quantity: a state-only quantity (such as a top-k KL at s_t) has zero expected policy gradient.

A per-token reward within `signal_floor` nats of 0 counts as 0 (docs/objectives.md, "A zero signal"): with teacher =
student, `r_t` is the sampler's rounding against the teacher's forward (|r_t| up to 1.14e-5 nats in fp32 on the CPU),
and Adam, which divides by the gradient's own scale, would turn that into steps of about the learning rate.
"""

from __future__ import annotations

import math

import torch

from miniverl.objectives.advantages import discounted_returns
from miniverl.objectives.aggregation import masked_mean, require_same_shape, step_token_mean
from miniverl.objectives.ratios import DEFAULT_IS_CAP, SamplerTolerance, importance_ratio, ratio_metrics


def below_floor_to_zero(rewards: torch.Tensor, signal_floor: float) -> torch.Tensor:
    """`rewards` with every entry of magnitude <= `signal_floor` (nats) set to exactly 0. Shapes: [...] -> [...]."""
    if not signal_floor >= 0.0:
        raise ValueError(f"signal_floor must be >= 0 nats, got {signal_floor}")
    return torch.where(rewards.abs() <= signal_floor, torch.zeros_like(rewards), rewards)


def k1_advantages(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    discount: float = 0.0,
    signal_floor: float = 0.0,
) -> torch.Tensor:
    """Detached advantages from the k1 reward `r_t = teacher - old`, discounted over future tokens.

    `A_t = sum_{k >= t} discount^(k - t) r_k` over the masked tokens of each row (discount 0: A_t = r_t); an
    `r_t` within `signal_floor` nats of 0 counts as 0.

    Shapes: teacher_logprobs, old_logprobs, mask [B, T] -> [B, T].
    """
    require_same_shape(teacher_logprobs=teacher_logprobs, old_logprobs=old_logprobs, mask=mask)
    rewards = (teacher_logprobs.detach() - old_logprobs.detach()) * mask.to(teacher_logprobs.dtype)
    return discounted_returns(below_floor_to_zero(rewards, signal_floor), mask, discount)


def truncated_pg_terms(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, is_cap: float
) -> torch.Tensor:
    """Each token's `-w_t A_t rho_t` (truncated_pg_loss before the mask and the step's token count): value
    `-w_t A_t`, gradient `-w_t A_t grad log q_theta(y_t)`, with `w_t = min(rho_t, is_cap)` detached.
    Shapes: [...] -> [...] (any shape, the three alike)."""
    weight = importance_ratio(logprobs, old_logprobs).clamp(max=is_cap)  # detached
    # exp(lp - lp.detach()) is 1 in value and carries grad log q: value -w A, gradient -w A grad log q.
    return -(weight * torch.exp(logprobs - logprobs.detach()) * advantages.detach())


def truncated_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_cap: float = DEFAULT_IS_CAP,
    num_step_tokens: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`-sum_t w_t A_t / N` whose gradient is `-sum_t w_t A_t grad log q_theta(y_t) / N`.

    `w_t = min(rho_t, is_cap)` with `rho_t = exp(logprobs - old_logprobs)`, used as a detached weight:
    where rho_t <= is_cap the value and gradient equal those of `rho_t A_t` exactly
    (grad rho = rho grad log q); above the cap the weight is truncated to is_cap instead of being
    dropped (truncated importance sampling, as verl). `old_logprobs` are the sampler's log-probs, so rho
    also corrects sampler/learner gaps. N is the step's response-token count (default: mask.sum()).
    Neither `old_logprobs` nor `advantages` receives a gradient.

    Shapes: logprobs, old_logprobs, advantages, mask [B, T] -> (scalar loss, metrics).
    """
    require_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if is_cap < 1.0:
        raise ValueError(f"is_cap must be >= 1 (verl uses about 2), got {is_cap}")
    mask = mask.to(logprobs.dtype)
    n = mask.sum().item() if num_step_tokens is None else num_step_tokens
    loss = step_token_mean(truncated_pg_terms(logprobs, old_logprobs, advantages, is_cap), mask, n)
    return loss, ratio_metrics(logprobs, old_logprobs, mask, is_cap)


def pg_k1_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    discount: float = 0.0,
    is_cap: float = DEFAULT_IS_CAP,
    num_step_tokens: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PG-k1 loss: advantage `r_t = teacher - old` (detached, discounted when discount > 0), truncated
    importance ratio `exp(logprobs - old_logprobs)` capped at `is_cap`, normalized by mask tokens
    (or by `num_step_tokens`, the response tokens of the whole optimizer step).

    On-policy (logprobs == old_logprobs in value) at discount 0 the loss value is the k1 estimate of
    the per-token reverse KL, `mean_t (log q - log p)`.

    Shapes: logprobs, old_logprobs, teacher_logprobs, mask [B, T] -> (scalar loss, metrics).
    """
    adv = k1_advantages(teacher_logprobs, old_logprobs, mask, discount)
    loss, metrics = truncated_pg_loss(logprobs, old_logprobs, adv, mask, is_cap, num_step_tokens)
    metrics["advantage_mean"] = masked_mean(adv, mask.to(adv.dtype))
    return loss, metrics


# PG-k1's advantage is log p - log q_sampler and its ratio is q_theta / q_sampler: a sampler gap enters
# every token's advantage as a bias. Its per-token signal in the default run is 0.5-4 nats (the reverse
# KL), so a mean bias of 0.02 stays under 4% of it; p99 0.1 keeps 99% of ratios within e^0.1 = 1.1 of
# 1, and at most 0.1% of them may leave [1/2, 2]. bf16 vLLM against HF (mean 0.08, p99 0.28: DESIGN.md)
# is outside, which is why the earlier line kept PG-k1 off vLLM; truncated importance sampling
# (objective.is_cap, finite) corrects it. objective.is_cap=inf turns truncation off.
PG_K1_GAP_BOUNDS = {"mean_gap": 0.02, "p99_gap": 0.1, "outside_frac": 1e-3}


class PgK1Objective:
    """PG-k1 in the learner, with an optional reference-KL penalty and GRPO-normalized task reward.

    Per-token reward `r_t = teacher_coef * (log p - log q_sampler) - kl_coef * kl(q_sampler, ref)`, discounted into
    `A_t`, plus `reward_coef * grpo(task score)` on every token of the sequence. The reference is the
    student with its adapter disabled (no second model).
    """

    teacher_support_k = None  # only the sampled token's teacher log-prob is needed
    loss_temperature = 1.0

    def __init__(
        self,
        discount: float,
        is_cap: float,
        kl_coef: float,
        kl_kind: str,
        reward_coef: float,
        teacher_coef: float = 1.0,
        signal_floor: float = 0.0,
    ) -> None:
        """`teacher_coef` (objective.teacher_coef) weighs the k1 signal (0 with reward_coef > 0: GRPO alone).
        `signal_floor` (objective.signal_floor, nats): a per-token reward (k1 and reference penalty together)
        within it of 0 counts as 0, so a teacher equal to the student moves nothing (0: only an exact 0)."""
        from miniverl.objectives.kl import KL_KINDS

        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount}")
        if is_cap < 1.0:
            raise ValueError(f"is_cap must be >= 1, got {is_cap}")
        if kl_kind not in KL_KINDS:
            raise ValueError(f"unknown KL estimator {kl_kind!r}; known: {', '.join(KL_KINDS)}")
        if kl_coef < 0 or reward_coef < 0 or teacher_coef < 0:
            raise ValueError(
                f"kl_coef, reward_coef, teacher_coef must be >= 0: {kl_coef}, {reward_coef}, {teacher_coef}"
            )
        if not signal_floor >= 0:
            raise ValueError(f"signal_floor must be >= 0 nats, got {signal_floor}")
        self.teacher_coef = teacher_coef
        self.discount, self.is_cap, self.signal_floor = discount, is_cap, signal_floor
        self.kl_coef, self.kl_kind, self.reward_coef = kl_coef, kl_kind, reward_coef
        self.needs_reference = kl_coef > 0
        truncated = math.isfinite(is_cap)
        self.sampler_tolerance = SamplerTolerance(
            **PG_K1_GAP_BOUNDS, cap=is_cap if truncated else DEFAULT_IS_CAP, truncated=truncated
        )

    @classmethod
    def from_config(cls, cfg) -> PgK1Objective:
        return cls(
            cfg.discount, cfg.is_cap, cfg.kl_coef, cfg.kl_kind, cfg.reward_coef, cfg.teacher_coef, cfg.signal_floor
        )

    # A batch one version behind (trainer.staleness=1) takes its advantage from the current policy's log-probs
    # (the learner computes them before the update); the importance ratio stays against the sampler's.
    needs_current_logprobs = True

    def prepare(self, batch, scores, rewards, ref_log_prob, current_log_probs=None) -> torch.Tensor:
        """Whole-batch advantages (groups and discounting need every row). Shapes: -> [B, Tr].

        `current_log_probs` [B, Tr]: for a batch sampled by an older policy, the learner's log-probs of its
        tokens under the policy being updated; they replace the sampler's as q_old in the k1 reward and the
        reference penalty, so the expected gradient stays that of the current policy's reverse KL
        (docs/objectives.md, "One-step-stale rollouts"). None: the sampler is the current policy."""
        from miniverl.objectives.advantages import grpo_advantages
        from miniverl.objectives.kl import kl_penalty

        mask = batch.response_mask.float()
        old = batch.rollout_log_probs if current_log_probs is None else current_log_probs
        token_reward = self.teacher_coef * (scores.teacher_log_probs - old) * mask
        if self.kl_coef > 0:
            if ref_log_prob is None:
                raise ValueError("objective.kl_coef > 0 needs reference log-probs; the learner passed none")
            token_reward = token_reward - self.kl_coef * kl_penalty(old, ref_log_prob, self.kl_kind) * mask
        adv = discounted_returns(below_floor_to_zero(token_reward, self.signal_floor), mask, self.discount)
        if self.reward_coef > 0:
            if rewards is None:
                raise ValueError("objective.reward_coef > 0 needs task rewards; the controller passed none")
            adv = adv + self.reward_coef * grpo_advantages(rewards, batch.uid).unsqueeze(1) * mask
        return adv.detach()

    token_terms = None  # the loss needs only the sampled tokens' log-probs, no per-token term from the logits
    closed_form_head = True  # so the fused LM head never runs autograd over [c, V] (models/fused_head.py)

    def token_loss(self, logprobs, terms, sampler_logprobs, advantages, num_step_tokens):
        """Each token's share of the step loss (truncated_pg_loss per token, so their sum is its loss): value
        -w_t A_t / N, gradient -w_t A_t grad log q_theta(y_t) / N. Shapes: [c] -> [c]; `terms` is unused."""
        return truncated_pg_terms(logprobs, sampler_logprobs, advantages, self.is_cap) / num_step_tokens

    def loss_from_terms(self, logprobs, terms, batch, scores, advantages, num_step_tokens):
        """Shapes: logprobs [b, Tr], advantages [b, Tr] -> (scalar loss, metrics); `terms` is unused (None)."""
        device = logprobs.device
        return truncated_pg_loss(
            logprobs,
            batch.rollout_log_probs.to(device),
            advantages.to(device),
            batch.response_mask.to(device),
            self.is_cap,
            num_step_tokens,
        )

    def loss(self, logits, logprobs, batch, scores, advantages, num_step_tokens):
        """Shapes: logprobs [b, Tr], advantages [b, Tr] -> (scalar loss, metrics); `logits` is unused."""
        return self.loss_from_terms(logprobs, None, batch, scores, advantages, num_step_tokens)
