"""Loss aggregation over the response tokens of a whole optimizer step."""

from __future__ import annotations

import torch


def step_token_mean(token_values: torch.Tensor, mask: torch.Tensor, num_step_tokens: int | float) -> torch.Tensor:
    """Sum of `token_values` over `mask`, divided by the response tokens of the whole optimizer step.

    A micro-batch passes the step's token count, so summing the micro-batch results (and their
    gradients) gives exactly the full-batch token mean whatever the split.

    Shapes: token_values, mask [B, T] -> scalar.
    """
    if num_step_tokens <= 0:
        raise ValueError("num_step_tokens must be positive: the step has no response tokens")
    return (token_values * mask).sum() / num_step_tokens


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (0 when the mask is empty). Shapes: [B, T] -> scalar."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
