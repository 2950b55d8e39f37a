"""Loss normalization by the response tokens of the whole optimizer step."""

from __future__ import annotations

import pytest
import torch

from miniverl.objectives import masked_mean, step_token_mean


def test_step_token_mean_closed_form():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert step_token_mean(values, mask, 3).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert step_token_mean(values, mask, 6).item() == pytest.approx(1.0)  # the step's count, not this batch's
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_micro_batches_sum_to_the_full_batch_token_mean():
    """Rows of very different lengths: a per-micro-batch mean would weight short rows up; this does not."""
    torch.manual_seed(0)
    values = torch.randn(8, 6, requires_grad=True)
    mask = (torch.arange(6) < torch.tensor([6, 1, 3, 2, 6, 5, 1, 4])[:, None]).long()
    n = int(mask.sum())
    full = step_token_mean(values, mask, n)
    (g_full,) = torch.autograd.grad(full, values)
    parts = sum(step_token_mean(values[i : i + 2], mask[i : i + 2], n) for i in range(0, 8, 2))
    (g_parts,) = torch.autograd.grad(parts, values)
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(g_parts, g_full)
    naive = sum(masked_mean(values[i : i + 2], mask[i : i + 2]) for i in range(0, 8, 2)) / 4
    assert abs(naive.item() - full.item()) > 1e-3  # the split would matter with per-micro-batch means


def test_bad_aggregation_inputs_are_rejected():
    with pytest.raises(ValueError, match="no response tokens"):
        step_token_mean(torch.zeros(2, 2), torch.zeros(2, 2), 0)
    with pytest.raises(ValueError, match="shapes must match"):
        step_token_mean(torch.zeros(2, 2), torch.zeros(2, 3), 4)
