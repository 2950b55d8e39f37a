"""Deterministic task rewards, chosen by name. A reward turns a RolloutBatch into one score per row."""

from __future__ import annotations

import torch

from miniverl.protocol import RolloutBatch


class ExactMatchReward:
    """1.0 when the decoded response (stop token excluded) equals the ground truth exactly, else 0.0.

    A response that ran out of tokens without a stop token scores 0: an answer must be finished.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:  # [B]
        texts = self.decode(batch)
        ok = [bool(f) and t == gt for t, gt, f in zip(texts, batch.ground_truth, batch.finished.tolist())]
        return torch.tensor(ok, dtype=torch.float32)

    def decode(self, batch: RolloutBatch) -> list[str]:
        out = []
        for row, mask in zip(batch.responses.tolist(), batch.response_mask.tolist()):
            ids = [t for t, m in zip(row, mask) if m]
            out.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        return out
