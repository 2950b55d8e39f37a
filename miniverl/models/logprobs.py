"""Log-probs of a RolloutBatch's response tokens under a model, and the learner's loss over them.

- `packed_token_loss`: the learner's path. Rows in a token-budget micro-batch without inner padding
  (models/packing.py), the decoder once, then the LM head fused with the objective's per-token loss, one chunk
  of response tokens at a time forward and backward (models/fused_head.py): no [B, Tr, V] tensor exists.
- `packed_logprobs`: the same layout without gradient (the reference policy).
- `response_logits` + `token_logprobs`: the direct way, the model's own forward over the left-padded batch
  with its [B, Tr, V] logits; the exactness reference of the tests and the bench's oracle.
- `sequence_logprobs`: probes (fixed token sequences), the decoder once and the LM head in chunks.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from miniverl.batches import RolloutBatch, TeacherScores
from miniverl.models.fused_head import Support, fused_head_loss, head_logprobs
from miniverl.models.packing import PackedRows, lm_parts, packed_hidden

if TYPE_CHECKING:
    from miniverl.objectives.interface import Objective

# Rows of [Tr, V] logits turned into fp32 log-probs at once in the direct path (see the module note).
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


# Positions per LM-head chunk of a probe: [512, V] bf16 logits and their fp32 copy are 0.45 GiB at a 152k
# vocabulary, inside any actor's share of a 16 GB card (the conformance gate sends 64 rows of ~270 tokens).
SEQUENCE_CHUNK_TOKENS = 512


@torch.no_grad()
def sequence_logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    """log p(seq[t] | seq[:t]) for t = 1..len-1 of each sequence, temperature 1, fp32, through `model`: its
    decoder once over the right-padded sequences (no mask: a causal model's real positions never see trailing
    padding, as in the learner's packed rows), then the LM head a chunk of positions at a time (no [B, T, V])."""
    device = next(model.parameters()).device
    ids, mask = right_pad(sequences)  # [B, T] each
    decoder, head = lm_parts(model)
    hidden = decoder(input_ids=ids.to(device), use_cache=False).last_hidden_state  # [B, T, H]
    rows, cols = mask[:, 1:].nonzero(as_tuple=True)  # positions that predict a real next token, row-major
    picked = hidden[rows.to(device), cols.to(device)]  # [N, H]
    flat = head_logprobs(picked, head, ids[rows, cols + 1], SEQUENCE_CHUNK_TOKENS).cpu().tolist()  # [N]
    out, start = [], 0
    for s in sequences:
        out.append(flat[start : start + len(s) - 1])
        start += len(s) - 1
    return out


def score_tokens(scores: TeacherScores, start: int, stop: int) -> TeacherScores:
    """The teacher's scores of positions [start, stop) of every row. Shapes: [B, Tr, ...] -> [B, c, ...]."""

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:, start:stop]

    return dataclasses.replace(
        scores,
        teacher_log_probs=scores.teacher_log_probs[:, start:stop],
        teacher_topk_logprobs=cut(scores.teacher_topk_logprobs),
        teacher_topk_ids=cut(scores.teacher_topk_ids),
        teacher_tail_logprob=cut(scores.teacher_tail_logprob),
    )


def flat_scores(scores: TeacherScores, rows: torch.Tensor, cols: torch.Tensor, device) -> TeacherScores:
    """The teacher's scores of N (row, column) response tokens as one row, moved to `device` in one copy each,
    except a full-vocabulary support ([1, N, V]: too large to hold there; each LM-head chunk moves its own
    slice). One copy per micro-batch: a CPU tensor moved inside the chunk loop would wait for the GPU every
    chunk. Shapes: [B, Tr, ...] -> [1, N, ...]."""
    full = scores.teacher_topk_logprobs is not None and scores.teacher_topk_ids is None

    def pick(t: torch.Tensor | None, move: bool = True) -> torch.Tensor | None:
        if t is None:
            return None
        t = t[rows, cols].unsqueeze(0)
        return t.to(device) if move else t

    return dataclasses.replace(
        scores,
        teacher_log_probs=pick(scores.teacher_log_probs),
        teacher_topk_logprobs=pick(scores.teacher_topk_logprobs, move=not full),
        teacher_topk_ids=pick(scores.teacher_topk_ids),
        teacher_tail_logprob=pick(scores.teacher_tail_logprob),
    )


def packed_token_loss(
    model,
    batch: RolloutBatch,
    packed: PackedRows,
    scores: TeacherScores | None,
    objective: Objective,
    advantages: torch.Tensor | None,
    num_step_tokens: int,
    chunk_tokens: int,
    row_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The objective's loss over the packed rows' response tokens through the fused LM head, and each
    token's log-prob and term (detached), in the packed order (`packed.rows`, `packed.cols`).

    `row_weights` multiplies each row's token losses (trainer.loss_weight_by_source); None leaves them as the
    objective computes them.

    `objective` gives `token_terms(logits, scores)` (None when the loss needs only log-probs), and when it has
    terms `support_ids(scores)` (the ids its `support_terms(support, tail, scores)` reads, or None) and
    `token_loss(logprobs, terms, sampler_logprobs, advantages, num_step_tokens)`; `scores` may be None only
    when `token_terms` is. Shapes: row_weights [B] -> (scalar fp32, [N] fp32, [N] or None), on the model's device.
    """
    hidden, head = packed_hidden(model, packed)  # [N, H]
    device = hidden.device
    sampler = batch.rollout_log_probs[packed.rows, packed.cols].to(device)  # [N]
    adv = None if advantages is None else advantages[packed.rows, packed.cols].to(device)  # [N]
    weights = None if row_weights is None else row_weights[packed.rows].to(device, torch.float32)  # [N]
    term_fn, support = None, None
    if objective.token_terms is not None:
        flat = flat_scores(scores, packed.rows, packed.cols, device)  # [1, N, ...]
        support_ids = objective.support_ids(flat)  # [1, N, K] or None

        def chunk_scores(positions: slice) -> TeacherScores:
            return score_tokens(flat, positions.start, positions.stop)

        if support_ids is not None:  # the terms read only K log-probs and the tail's: closed-form gradient

            def support_terms(sup: torch.Tensor, tail: torch.Tensor, positions: slice) -> torch.Tensor:
                return objective.support_terms(sup[None], tail[None], chunk_scores(positions))[0]

            support = Support(support_ids[0], support_terms)
        else:

            def term_fn(logits: torch.Tensor, positions: slice) -> torch.Tensor:
                return objective.token_terms(logits, chunk_scores(positions))

    def loss_fn(logprobs: torch.Tensor, terms: torch.Tensor | None, positions: slice) -> torch.Tensor:
        a = None if adv is None else adv[positions]
        loss = objective.token_loss(logprobs, terms, sampler[positions], a, num_step_tokens)
        return loss if weights is None else loss * weights[positions]

    return fused_head_loss(hidden, head, packed.targets, chunk_tokens, term_fn, loss_fn, support)


@torch.no_grad()
def packed_logprobs(model, packed: PackedRows, chunk_tokens: int) -> torch.Tensor:
    """The policy's log-probs of the packed response tokens, no gradient. Shapes: -> [N] float32."""
    hidden, head = packed_hidden(model, packed)  # [N, H]
    return head_logprobs(hidden, head, packed.targets, chunk_tokens)
