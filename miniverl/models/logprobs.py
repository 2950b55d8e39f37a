"""Forward passes over a RolloutBatch and memory-frugal sampled-token log-probs."""

from __future__ import annotations

import torch

from miniverl.protocol import RolloutBatch

# Rows of [Tr, V] logits turned into fp32 log-probs at once. A 152k vocabulary at fp32 is 0.6 MB per
# token: materializing log-softmax for 16 rows x 256 tokens peaked the learner at 17 GiB (DESIGN.md).
LOGPROB_CHUNK_ROWS = 4


def response_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """Logits that predict each response token: position Tp-1+t predicts responses[:, t].

    Shapes: -> [B, Tr, V] in the model's dtype.
    """
    device = next(model.parameters()).device
    tr = batch.responses.shape[1]
    out = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        use_cache=False,
        logits_to_keep=tr + 1,  # only the positions that predict response tokens (and the last one)
    )
    return out.logits[:, :tr]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at `ids`, in fp32, a few rows at a time.

    Shapes: logits [B, T, V], ids [B, T] -> [B, T] float32.
    """
    out = []
    for start in range(0, logits.shape[0], LOGPROB_CHUNK_ROWS):
        chunk = logits[start : start + LOGPROB_CHUNK_ROWS].float() / temperature  # [b, T, V]
        picked = chunk.gather(-1, ids[start : start + LOGPROB_CHUNK_ROWS].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out, dim=0)


def right_pad(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes: -> ids [B, T] long, mask [B, T] long (right-padded: a causal model never sees the padding)."""
    if not sequences or min(map(len, sequences)) < 2:
        raise ValueError("every probe sequence needs at least 2 tokens (one context token, one to score)")
    t = max(map(len, sequences))
    ids = torch.full((len(sequences), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), t), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def unpad_logprobs(logprobs: torch.Tensor, sequences: list[list[int]]) -> list[list[float]]:
    """Per-sequence lists from right-padded next-token log-probs. Shapes: logprobs [B, T-1] -> ragged."""
    return [row[: len(s) - 1].tolist() for row, s in zip(logprobs.float().cpu(), sequences)]


SEQUENCE_CHUNK_ROWS = 2


@torch.no_grad()
def sequence_logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    """log p(seq[t] | seq[:t]) for t = 1..len-1 of each sequence, temperature 1, fp32, through `model`."""
    device = next(model.parameters()).device
    out: list[list[float]] = []
    # A few rows per forward: the conformance gate sends 64 rows of ~270 tokens, whose [B, T, V] bf16 logits
    # at a 152k vocabulary (5.1 GiB) overran the learner's 4.8 GiB share of a 16 GB card (H200, 16 GB emulation).
    for start in range(0, len(sequences), SEQUENCE_CHUNK_ROWS):
        part = sequences[start : start + SEQUENCE_CHUNK_ROWS]
        ids, mask = right_pad(part)  # [b, T] each
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits  # [b, T, V]
        out += unpad_logprobs(token_logprobs(logits[:, :-1], ids[:, 1:].to(device)), part)
        del logits
    return out
