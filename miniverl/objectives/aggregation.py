"""Loss aggregation over the response tokens of a whole optimizer step, and the shared shape check."""

from __future__ import annotations

import torch


def require_same_shape(**tensors: torch.Tensor) -> None:
    """Raise a ValueError naming every shape when the tensors differ: broadcasting would hide the bug."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shapes must match: {listed}")


def step_token_mean(token_values: torch.Tensor, mask: torch.Tensor, num_step_tokens: int | float) -> torch.Tensor:
    """Sum of `token_values` over `mask`, divided by the response tokens of the whole optimizer step.

    A micro-batch passes the step's token count, so summing the micro-batch results (and their
    gradients) gives exactly the full-batch token mean whatever the split.

    Shapes: token_values, mask [B, T] -> scalar.
    """
    require_same_shape(token_values=token_values, mask=mask)
    if num_step_tokens <= 0:
        raise ValueError("num_step_tokens must be positive: the step has no response tokens")
    return (token_values * mask.to(token_values.dtype)).sum() / num_step_tokens


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (0 when the mask is empty). Shapes: [B, T] -> scalar."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
