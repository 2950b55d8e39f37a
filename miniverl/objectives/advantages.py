"""Advantages: GRPO group normalization (verl rules) and discounted per-token returns."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miniverl.objectives.aggregation import require_same_shape

GRPO_EPS = 1e-6  # verl compute_grpo_outcome_advantage: (s - mean) / (std + eps)


def grpo_advantages(scores: torch.Tensor, uid: Sequence[str], norm_by_std: bool = True) -> torch.Tensor:
    """Group-normalized sequence scores: per uid group `(s - mean) / (std + 1e-6)`.

    The std is the unbiased one (torch.std, as verl). A group of one has mean 0 and std 1 (verl's
    rule), so its advantage is `s / (1 + 1e-6)`: its raw score, not 0. With norm_by_std=False only
    the mean is removed. A group whose scores are all equal gets 0 (std 0, so 0 / 1e-6).

    `scores` are sequence scores (verl sums `token_level_rewards` over the response first).

    Shapes: scores [B], uid length B -> [B].
    """
    if scores.dim() != 1 or scores.shape[0] != len(uid):
        raise ValueError(f"scores must be [B] with one uid per row; got {tuple(scores.shape)} and {len(uid)}")
    scores = scores.detach() if scores.is_floating_point() else scores.float()
    groups: dict[str, list[int]] = {}
    for i, u in enumerate(uid):
        groups.setdefault(u, []).append(i)
    out = torch.empty_like(scores)
    for rows in groups.values():
        s = scores[rows]
        if len(rows) == 1:
            mean, std = scores.new_zeros(()), scores.new_ones(())
        else:
            mean, std = s.mean(), s.std()
        out[rows] = (s - mean) / (std + GRPO_EPS) if norm_by_std else s - mean
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """Per-token return `A_t = sum_{k>=t} discount^(k-t) r_k` over masked tokens of each row.

    discount 0 gives `A_t = r_t`. Tokens outside the mask contribute nothing and get 0.

    Shapes: rewards, mask [B, T] -> [B, T].
    """
    require_same_shape(rewards=rewards, mask=mask)
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    mask = mask.to(rewards.dtype)
    rewards = rewards * mask
    if discount == 0.0:
        return rewards
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + discount * running * mask[:, t]
        out[:, t] = running
    return out * mask
