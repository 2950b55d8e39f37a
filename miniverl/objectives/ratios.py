"""Learner/sampler importance ratios: the truncation cap and the clipped fraction every objective logs."""

from __future__ import annotations

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
    before an objective's math no longer holds (the conformance gate, miniverl/conformance.py).

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
