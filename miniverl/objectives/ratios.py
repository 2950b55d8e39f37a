"""Learner/sampler importance ratios: the truncation cap and the clipped fraction every objective logs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from miniverl.objectives.aggregation import masked_mean

# verl's truncated importance sampling (TIS) caps the learner/sampler ratio at about 2.
DEFAULT_IS_CAP = 2.0
# What truncation can correct. TIS fixes the odd ratio outside [1/cap, cap]; when most ratios are outside,
# the capped gradient is another objective, not a corrected one. bf16 vLLM against HF bf16 (mean 0.08,
# p99 0.28, well under 1% of ratios outside [1/2, 2]) is inside these bounds; a bf16 base served against an
# NF4 learner (mean 1.66 nats, 75% of ratios outside: DESIGN.md) is far outside both. 0.25 is 3x the
# former's mean and under a sixth of the latter's; 5% is 5x the former's tail.
TIS_MAX_MEAN_GAP = 0.25
TIS_MAX_OUTSIDE_FRAC = 0.05
# The per-step bound, calibrated at the conformance gate from this run's honest gap (its backend, dtype, model and
# sampling settings). A step of N sampled tokens may reach a mean |gap| of STEP_MEAN_MULTIPLE x the gate's mean
# plus STEP_SPREAD_Z standard errors of the gate's per-token spread (its std or p99, the larger, / sqrt(N): a step
# of 16 tokens is one rare token from its mean, a step of 100k is not), and hold at most STEP_TAIL_SHARE of its
# tokens (plus STEP_SPREAD_Z binomial errors) beyond STEP_TAIL_MULTIPLE x the gate's p99. Measured (lab/results/
# sampler-gap/, lab/measurements/sampler_gap_faults.py): 0 false alarms in 1,000 honest CPU steps (hf_reference and
# hf_cached, bf16; 1,000 more each beside the version test, objectives/sampler_check.py) and on the H200 (4080
# recipe, a step's mean at most 1.0x the gate's). The floors keep an fp32 run (gaps of 1e-7 nats) from flagging
# rounding; the objective's own bound stays the ceiling.
STEP_MEAN_MULTIPLE = 3.0
STEP_SPREAD_Z = 6.0
STEP_MEAN_FLOOR = 1e-4
STEP_TAIL_MULTIPLE = 4.0
STEP_TAIL_FLOOR = 1e-3
STEP_TAIL_SHARE = 0.05


def importance_ratio(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    """`rho_t = q_theta(y_t) / q_sampler(y_t)` as a detached value. Shapes: [B, T] -> [B, T]."""
    return torch.exp(logprobs.detach() - sampler_logprobs.detach())


def ratio_metrics(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, is_cap: float = DEFAULT_IS_CAP
) -> dict[str, torch.Tensor]:
    """Fraction of response tokens whose ratio exceeds `is_cap` (truncated), and the mean ratio.

    Both objectives report these with the same cap, so a sampler/learner mismatch shows up the same
    way in every run. Shapes: [B, T] -> scalars.
    """
    ratio = importance_ratio(logprobs, sampler_logprobs)  # [B, T]
    mask = mask.to(ratio.dtype)
    return {
        "clipped_ratio_frac": masked_mean((ratio > is_cap).to(ratio.dtype), mask),
        "ratio_mean": masked_mean(ratio, mask),
    }


@dataclass(frozen=True)
class SamplerTolerance:
    """How far the sampler's log-probs of its own sampled tokens may sit from the learner's recomputation
    before an objective's math no longer holds (the conformance gate, miniverl/step/conformance.py).

    Gaps are |log q_sampler(y_t) - log q_learner(y_t)| in nats over sampled tokens; `outside_frac` is the
    fraction of ratios q_learner / q_sampler outside [1/cap, cap]. `truncated` is True when the objective
    truncates its importance ratios (TIS), which corrects a sampler outside these bounds.
    """

    mean_gap: float
    p99_gap: float
    outside_frac: float
    cap: float
    truncated: bool

    @property
    def max_mean_gap(self) -> float:
        """The mean gap (nats) no correction excuses: the gate's bound without TIS, TIS_MAX_MEAN_GAP with
        it. The learner holds every step's sampled tokens to it before optimizer.step()."""
        return max(self.mean_gap, TIS_MAX_MEAN_GAP) if self.truncated else self.mean_gap

    @property
    def max_outside_frac(self) -> float:
        """The fraction of ratios outside [1/cap, cap] no correction excuses (as max_mean_gap)."""
        return max(self.outside_frac, TIS_MAX_OUTSIDE_FRAC) if self.truncated else self.outside_frac

    def step_bound(self, gate_mean: float | None = None, gate_p99: float | None = None, gate_std: float = 0.0):
        """The bound every step's sampled tokens are held to before optimizer.step() (a StepGapBound): calibrated
        from the gate's honest gap (mean, p99 and per-token std of |gap|, nats) when given, else the objective's own
        (max_mean_gap, p99_gap). Never looser than the objective's."""
        ceiling_tail = max(self.p99_gap, math.log(self.cap)) if self.truncated else self.p99_gap
        if gate_mean is None or gate_p99 is None:
            return StepGapBound(self.max_mean_gap, 0.0, self.max_mean_gap, ceiling_tail, STEP_TAIL_SHARE, "objective")
        mean = max(STEP_MEAN_MULTIPLE * gate_mean, STEP_MEAN_FLOOR)
        tail = min(ceiling_tail, max(STEP_TAIL_MULTIPLE * gate_p99, STEP_TAIL_FLOOR))
        # the per-token scale of the spread: the gate's std, or its p99 when larger (a gate of a few hundred tokens
        # sees few of bf16's rare large gaps, so its std understates how far one token moves a small step's mean)
        spread = STEP_SPREAD_Z * max(gate_std, gate_p99)
        return StepGapBound(mean, spread, self.max_mean_gap, tail, STEP_TAIL_SHARE, "gate")


@dataclass(frozen=True)
class StepGapBound:
    """What a step's sampler gap may be (|log q_sampler - log q_learner| over its N sampled tokens, nats): a mean of
    at most `mean + spread / sqrt(N)` (never above `ceiling`, the objective's), and at most `tail_share` of its tokens
    (plus STEP_SPREAD_Z binomial errors) beyond `tail`. `source`: gate (calibrated from this run's honest gap) or
    objective (the objective's own bound, before a gate ran)."""

    mean: float
    spread: float
    ceiling: float
    tail: float
    tail_share: float
    source: str

    def mean_at(self, tokens: int) -> float:
        return min(self.ceiling, self.mean + self.spread / math.sqrt(max(tokens, 1)))

    def tail_share_at(self, tokens: int) -> float:
        p = self.tail_share
        return p + STEP_SPREAD_Z * math.sqrt(p * (1 - p) / max(tokens, 1))
