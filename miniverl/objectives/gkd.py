"""Direct GKD (Agarwal et al., ICLR 2024): generalized Jensen-Shannon divergence per response token.

`JSD_beta(p || q) = beta KL(p || m) + (1 - beta) KL(q || m)`, `m = beta p + (1 - beta) q`, p the teacher,
q the student. As beta -> 0 the mixture form vanishes like beta * KL(p || q), and as beta -> 1 like
(1 - beta) * KL(q || p), so the endpoints are defined as the exact KLs: beta = 0 is forward KL(p || q),
beta = 1 is reverse KL(q || p) (as TRL's GKDTrainer does). Gradient flows into every student logit.

Top-k support: only the teacher's K most likely tokens travel between actors. The rest of the
vocabulary is kept as one *tail bucket*: the divergence is computed over K + 1 categories, the K
tokens plus the tail mass of each distribution (teacher: 1 - sum of its top-K probabilities, or the
exact value when the scorer ships it; student: its exact mass outside the K ids). This is the
divergence between the two distributions coarsened to K + 1 outcomes. Merging outcomes maps p, q and
their mixture m alike, so by the data processing inequality each KL term can only shrink: the result
never exceeds the full divergence, grows with K for nested supports, and equals it once the tail holds
at most one token (K >= V - 1).

A zero signal gives a zero gradient (docs/objectives.md, "A zero signal"): a token whose teacher and student
log-probs agree within `signal_floor` nats at every category contributes 0 to the loss and exactly 0 to the
gradient. Computed as written, the divergence of two bitwise-equal distributions is not exactly 0: the mixture's
log rounds to t +- 1 ulp, leaving a gradient of ~1e-9 per adapter entry that Adam, which divides by the
gradient's own scale, turns into steps of a sizeable share of the learning rate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from miniverl.objectives.aggregation import masked_mean, require_same_shape, step_token_mean
from miniverl.objectives.ratios import DEFAULT_IS_CAP, SamplerTolerance, ratio_metrics

# A teacher tail that rounds to 0 (fp32 sum of a peaked top-K) would make reverse KL infinite wherever
# the student keeps any tail mass; the smallest normal float32 keeps it finite and still punishing.
TAIL_FLOOR = torch.finfo(torch.float32).tiny

# GKD never uses the sampler's log-probs: they only pick the states, and a slightly different sampler
# makes the step slightly off-policy, which the divergence tolerates (it is minimized over any state
# distribution). It refuses only a sampler that is plainly another policy: a mean gap of 0.5 nats is 6x
# bf16-vs-bf16 serving (mean 0.08, p99 0.28) and under a third of a bf16 base served against an NF4
# learner (mean 1.66, 75% of ratios outside [0.5, 2]), all measured on an H200 (DESIGN.md).
GKD_SAMPLER_TOLERANCE = SamplerTolerance(
    mean_gap=0.5, p99_gap=2.0, outside_frac=0.25, cap=DEFAULT_IS_CAP, truncated=False
)


def _sum_plogp_ratio(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """sum_i a_i (log a_i - log b_i) over the last dim, with 0 * log(0 / b) = 0 (also in the gradient)."""
    zero = torch.isneginf(log_a)
    safe_a = torch.where(zero, torch.zeros_like(log_a), log_a)
    safe_b = torch.where(zero, torch.zeros_like(log_b), log_b)
    a = torch.where(zero, torch.zeros_like(log_a), safe_a.exp())
    return (a * (safe_a - safe_b)).sum(dim=-1)


def agree_within(teacher_logp: torch.Tensor, student_logp: torch.Tensor, signal_floor: float) -> torch.Tensor:
    """Positions where the two log-distributions differ by at most `signal_floor` nats at every category (equal
    -inf entries agree). Shapes: [B, T, C] -> [B, T] bool."""
    close = (teacher_logp == student_logp) | ((teacher_logp - student_logp).abs() <= signal_floor)
    return close.all(dim=-1)


def jsd_from_logprobs(
    teacher_logp: torch.Tensor, student_logp: torch.Tensor, beta: float, signal_floor: float = 0.0
) -> torch.Tensor:
    """Generalized JSD between two normalized log-distributions over the last dim. Where they agree within
    `signal_floor` nats at every category (0: only where they are equal) the result is 0, with gradient 0.

    Shapes: teacher_logp, student_logp [B, T, C] -> [B, T].
    """
    require_same_shape(teacher_logp=teacher_logp, student_logp=student_logp)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not signal_floor >= 0.0:
        raise ValueError(f"signal_floor must be >= 0 nats, got {signal_floor}")
    if beta == 0.0:
        jsd = _sum_plogp_ratio(teacher_logp, student_logp)  # forward KL(p || q)
    elif beta == 1.0:
        jsd = _sum_plogp_ratio(student_logp, teacher_logp)  # reverse KL(q || p)
    else:
        mix = torch.logaddexp(teacher_logp + math.log(beta), student_logp + math.log1p(-beta))  # log m
        jsd = beta * _sum_plogp_ratio(teacher_logp, mix) + (1.0 - beta) * _sum_plogp_ratio(student_logp, mix)
    # where(), not a product: the agreeing tokens' gradient is exactly 0 (their JSD's rounding residue never reaches
    # the adapter), and the condition is a comparison, so it carries no gradient of its own.
    return torch.where(agree_within(teacher_logp, student_logp, signal_floor), torch.zeros_like(jsd), jsd)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 at least (bf16/fp16 logits lose too much in log-softmax); float64 stays float64 (tests)."""
    return x if x.dtype == torch.float64 else x.float()


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    signal_floor: float = 0.0,
) -> torch.Tensor:
    """Per-token generalized JSD over the full vocabulary, both distributions at `temperature`.

    Exact forward KL(p || q) at beta = 0 and reverse KL(q || p) at beta = 1; 0 where the log-probs agree within
    `signal_floor` nats everywhere (jsd_from_logprobs).

    Shapes: student_logits, teacher_logits [B, T, V] -> [B, T] (nats).
    """
    require_same_shape(student_logits=student_logits, teacher_logits=teacher_logits)
    _check_temperature(temperature)
    s = F.log_softmax(_upcast(student_logits) / temperature, dim=-1)  # [B, T, V]
    t = F.log_softmax(_upcast(teacher_logits) / temperature, dim=-1)  # [B, T, V]
    return jsd_from_logprobs(t, s, beta, signal_floor)


def topk_generalized_jsd(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    teacher_tail_logprob: torch.Tensor | None = None,
    signal_floor: float = 0.0,
) -> torch.Tensor:
    """Per-token generalized JSD over the teacher's top-K support plus one tail bucket (0 where the K + 1
    log-probs agree within `signal_floor` nats: jsd_from_logprobs).

    `teacher_topk_logprobs` must already be at the loss temperature: log_softmax(teacher_logits / T)
    at `teacher_topk_ids` (K distinct ids per position). The student logits are divided by
    `temperature` here. `teacher_tail_logprob` is log(1 - sum of the teacher's top-K probabilities);
    when omitted it is derived from the top-K log-probs, floored at TAIL_FLOOR. With K = V there is no
    tail bucket and the result is `generalized_jsd`; for K < V it is a lower bound of it.

    Shapes: student_logits [B, T, V], teacher_topk_* [B, T, K], teacher_tail_logprob [B, T] -> [B, T].
    """
    require_same_shape(teacher_topk_logprobs=teacher_topk_logprobs, teacher_topk_ids=teacher_topk_ids)
    if student_logits.dim() != 3 or student_logits.shape[:2] != teacher_topk_ids.shape[:2]:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} must be [B, T, V] with the [B, T] of the teacher"
            f" support {tuple(teacher_topk_ids.shape)}"
        )
    if teacher_topk_ids.shape[-1] > student_logits.shape[-1]:
        raise ValueError(
            f"top-K support of {teacher_topk_ids.shape[-1]} ids exceeds the vocabulary of {student_logits.shape[-1]}"
        )
    if teacher_tail_logprob is not None and teacher_tail_logprob.shape != teacher_topk_ids.shape[:2]:
        raise ValueError(f"teacher_tail_logprob {tuple(teacher_tail_logprob.shape)} must be [B, T]")
    _check_temperature(temperature)
    teacher_topk_ids = teacher_topk_ids.to(student_logits.device, torch.long)  # int32 in transit; gather needs long
    s_all = _upcast(student_logits) / temperature  # [B, T, V]
    log_z = torch.logsumexp(s_all, dim=-1, keepdim=True)  # [B, T, 1]
    s_k = s_all.gather(-1, teacher_topk_ids) - log_z  # [B, T, K]
    t_k = teacher_topk_logprobs.to(s_all.device, s_all.dtype)  # [B, T, K]
    if teacher_topk_ids.shape[-1] == s_all.shape[-1]:
        return jsd_from_logprobs(t_k, s_k, beta, signal_floor)  # the support is the whole vocabulary, permuted
    s_tail = torch.logsumexp(s_all.scatter(-1, teacher_topk_ids, float("-inf")), dim=-1) - log_z[..., 0]  # [B, T]
    return support_jsd(s_k, s_tail, t_k, teacher_tail_logprob, beta, signal_floor)


def support_jsd(
    student_support: torch.Tensor,
    student_tail: torch.Tensor,
    teacher_support: torch.Tensor,
    teacher_tail: torch.Tensor | None,
    beta: float,
    signal_floor: float = 0.0,
) -> torch.Tensor:
    """Generalized JSD over K support ids plus one tail bucket, from both sides' log-probs of them (the last
    step of `topk_generalized_jsd`; the learner's fused LM head computes the student's side itself).
    `teacher_tail` None derives it from the support, floored at TAIL_FLOOR; `signal_floor`: jsd_from_logprobs.
    Shapes: *_support [B, T, K], *_tail [B, T] -> [B, T]."""
    t_k = teacher_support.to(student_support.device, student_support.dtype)
    if teacher_tail is None:
        t_mass = (1.0 - t_k.exp().sum(dim=-1)).clamp(min=TAIL_FLOOR)  # [B, T]
        teacher_tail = t_mass.log()
    t_tail = teacher_tail.to(t_k.device, t_k.dtype).clamp(min=math.log(TAIL_FLOOR))  # [B, T]
    s_cat = torch.cat([student_support, student_tail.unsqueeze(-1)], dim=-1)  # [B, T, K+1]
    t_cat = torch.cat([t_k, t_tail.unsqueeze(-1)], dim=-1)  # [B, T, K+1]
    return jsd_from_logprobs(t_cat, s_cat, beta, signal_floor)


class GkdObjective:
    """Direct GKD in the learner: generalized JSD per response token against the teacher's support.

    The teacher's support arrives at the loss temperature (the scorer applies it), the student's
    logits are divided by the same temperature here; the sampling temperature is the rollout's.
    """

    needs_reference = False
    sampler_tolerance = GKD_SAMPLER_TOLERANCE  # the conformance gate's bound; no ratio to truncate

    def __init__(self, beta: float, loss_temperature: float, teacher_topk: int, signal_floor: float = 0.0) -> None:
        """`signal_floor` (objective.signal_floor, nats): a token whose teacher and student log-probs agree within
        it at every support entry and the tail adds nothing to the loss or its gradient (0: only exact equality)."""
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        _check_temperature(loss_temperature)
        if teacher_topk < 0:
            raise ValueError(f"teacher_topk must be 0 (full vocabulary) or K >= 1, got {teacher_topk}")
        self.beta = beta
        self.loss_temperature = loss_temperature
        if not signal_floor >= 0:
            raise ValueError(f"signal_floor must be >= 0 nats, got {signal_floor}")
        self.teacher_support_k = teacher_topk  # 0 = full vocabulary
        self.signal_floor = signal_floor

    @classmethod
    def from_config(cls, cfg) -> GkdObjective:
        return cls(
            beta=cfg.beta,
            loss_temperature=cfg.loss_temperature,
            teacher_topk=cfg.teacher_topk,
            signal_floor=cfg.signal_floor,
        )

    @property
    def closed_form_head(self) -> bool:
        """Whether the fused LM head takes its closed-form path (no autograd over [c, V]): a top-K support at
        loss temperature 1 (`support_ids`); the learner's memory model counts the chunk's buffers by it."""
        return self.teacher_support_k > 0 and self.loss_temperature == 1.0

    # GKD's loss reads no sampler log-prob, so a lagging batch needs no current-policy pass: its states come
    # from a policy one version behind, and the divergence is minimized at every state (docs/objectives.md).
    needs_current_logprobs = False

    def prepare(self, batch, scores, rewards, ref_log_prob, current_log_probs=None) -> torch.Tensor | None:
        return None  # GKD needs no batch-level advantages

    def token_terms(self, logits, scores) -> torch.Tensor:
        """Per-token generalized JSD against the teacher's support, for any slice of positions.

        The learner calls it on a whole micro-batch or on chunks of its positions (models/logprobs.py).
        Shapes: logits [b, t, V], scores' support [b, t, K or V] -> [b, t].
        """
        if scores.teacher_topk_logprobs is None:
            raise ValueError("GKD needs the teacher's support; the scorer returned none")
        if scores.loss_temperature != self.loss_temperature:
            raise ValueError(
                f"teacher support is at temperature {scores.loss_temperature}, the loss at {self.loss_temperature}"
            )
        if scores.teacher_topk_ids is None:  # full vocabulary, already at the loss temperature
            teacher = scores.teacher_topk_logprobs.to(logits.device).float()  # [b, t, V]
            require_same_shape(student_logits=logits, teacher_logprobs=teacher)
            student = F.log_softmax(logits.float() / self.loss_temperature, dim=-1)  # [b, t, V]
            return jsd_from_logprobs(teacher, student, self.beta, self.signal_floor)
        return topk_generalized_jsd(
            logits,
            scores.teacher_topk_logprobs,
            scores.teacher_topk_ids,
            self.beta,
            self.loss_temperature,
            scores.teacher_tail_logprob,
            self.signal_floor,
        )

    def support_ids(self, scores) -> torch.Tensor | None:
        """The vocabulary ids whose student log-probs (with the tail's) are all `support_terms` needs, or None
        when the terms need the whole distribution (full-vocabulary support, or a loss temperature other than 1:
        the sampled token's log-prob is at temperature 1, so both normalizers would be needed).
        Shapes: -> [b, t, K] or None."""
        ids = scores.teacher_topk_ids
        if ids is None or not self.closed_form_head or scores.teacher_topk_logprobs is None:
            return None
        return ids

    def support_terms(self, student_support, student_tail, scores) -> torch.Tensor:
        """`token_terms` from the student's log-probs at `support_ids` and of the tail bucket, for any slice of
        positions (the fused LM head's closed-form path). Shapes: [b, t, K], [b, t] -> [b, t]."""
        if scores.loss_temperature != self.loss_temperature:
            raise ValueError(
                f"teacher support is at temperature {scores.loss_temperature}, the loss at {self.loss_temperature}"
            )
        return support_jsd(
            student_support,
            student_tail,
            scores.teacher_topk_logprobs,
            scores.teacher_tail_logprob,
            self.beta,
            self.signal_floor,
        )

    def token_loss(self, logprobs, terms, sampler_logprobs, advantages, num_step_tokens):
        """Each token's share of the step loss: the fused LM-head path (models/fused_head.py) sums these over
        the step's tokens to the loss `loss_from_terms` returns. Shapes: [c] -> [c]."""
        return terms / num_step_tokens

    def loss_from_terms(self, logprobs, terms, batch, scores, advantages, num_step_tokens):
        """The step-normalized loss from per-token terms. Shapes: logprobs, terms [b, Tr] -> (scalar, metrics)."""
        device = terms.device
        mask = batch.response_mask.to(device, terms.dtype)
        metrics = {
            "jsd": masked_mean(terms.detach(), mask),
            # Same definition and default cap as PG-k1, so both objectives log a comparable number.
            **ratio_metrics(logprobs, batch.rollout_log_probs.to(device), mask, DEFAULT_IS_CAP),
        }
        return step_token_mean(terms, mask, num_step_tokens), metrics

    def loss(self, logits, logprobs, batch, scores, advantages, num_step_tokens):
        """Shapes: logits [b, Tr, V], logprobs [b, Tr] -> (scalar loss, metrics)."""
        terms = self.token_terms(logits, scores)
        return self.loss_from_terms(logprobs, terms, batch, scores, advantages, num_step_tokens)
