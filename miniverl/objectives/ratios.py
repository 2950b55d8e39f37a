"""Learner/sampler importance ratios: the truncation cap and the clipped fraction every objective logs."""

from __future__ import annotations

import torch

from miniverl.objectives.aggregation import masked_mean

# verl's truncated importance sampling (TIS) caps the learner/sampler ratio at about 2.
DEFAULT_IS_CAP = 2.0


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
