"""Forward passes over a RolloutBatch and memory-frugal sampled-token log-probs.

Two ways to get from the decoder to per-token quantities:
- direct (`response_logits`): the model's own forward returns [B, Tr, V] logits, which stay alive for
  backward along with their fp32 log-softmax. A 152k vocabulary at fp32 is 0.6 MB per token: 16 rows x
  256 tokens peaked the learner at 17 GiB (DESIGN.md).
- chunked (`chunked_token_terms`): the decoder's final hidden states [B, Tr, H] are kept, and the LM head,
  log-softmax and the objective's per-token term run on `chunk_tokens` positions at a time inside
  torch.utils.checkpoint, so backward recomputes each chunk's logits instead of keeping them: at most one
  chunk's [B, c, V] exists at any moment.
Both give the same numbers (tests/models/test_chunked_logprobs.py); which one runs is trainer.logprob_chunk_tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from miniverl.protocol import ConfigError, RolloutBatch, TeacherScores

# Rows of [Tr, V] logits turned into fp32 log-probs at once in the direct path (see the module note).
LOGPROB_CHUNK_ROWS = 4
# Model config attributes that make the logits something other than lm_head(final hidden state); the
# chunked path applies only the LM head, so it refuses such models instead of computing other numbers.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


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


def lm_parts(model):
    """(decoder, LM head) of a causal LM, peft-wrapped or not: logits = head(decoder(...).last_hidden_state)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    changed = [k for k in LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1.0)]
    if changed:
        raise ConfigError(
            f"{config.model_type} models transform their logits ({', '.join(changed)}), which the chunked"
            " log-prob path does not reproduce; set trainer.logprob_chunk_tokens=0 for this model"
        )
    return base.get_decoder(), base.get_output_embeddings()


def response_hidden(model, batch: RolloutBatch) -> tuple[torch.Tensor, torch.nn.Module]:
    """Final hidden states at the positions that predict response tokens, and the LM head that maps them.

    Shapes: -> hidden [B, Tr, H] in the model's dtype, head: [..., H] -> [..., V].
    """
    decoder, head = lm_parts(model)
    device = next(model.parameters()).device
    tr = batch.responses.shape[1]
    out = decoder(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        use_cache=False,
    )
    return out.last_hidden_state[:, -(tr + 1) : -1], head  # position Tp-1+t predicts responses[:, t]


TermFn = Callable[[torch.Tensor, int, int], torch.Tensor]  # (logits [B, c, V], start, stop) -> [B, c]


def chunked_token_terms(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    ids: torch.Tensor,
    chunk_tokens: int,
    term_fn: TermFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampled-token log-probs (fp32, temperature 1) and, when `term_fn` is given, a per-token term computed
    from each chunk's logits, `chunk_tokens` positions at a time; backward recomputes each chunk's logits.

    `term_fn(logits, start, stop)` gets the chunk's [B, c, V] logits and its token range, and returns [B, c].
    Shapes: hidden [B, T, H], ids [B, T] -> ([B, T] float32, [B, T] or None).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

    def piece(h: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        logits = head(h)  # [B, c, V], freed after this chunk (recomputed in backward)
        lp = token_logprobs(logits, ids[:, start:stop])  # [B, c]
        return (lp,) if term_fn is None else (lp, term_fn(logits, start, stop))

    parts = []
    for start in range(0, hidden.shape[1], chunk_tokens):
        stop = min(start + chunk_tokens, hidden.shape[1])
        h = hidden[:, start:stop]  # [B, c, H]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(piece, h, start, stop, use_reentrant=False))
        else:
            parts.append(piece(h, start, stop))
    logprobs = torch.cat([p[0] for p in parts], dim=1)
    terms = None if term_fn is None else torch.cat([p[1] for p in parts], dim=1)
    return logprobs, terms


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


def policy_token_terms(
    model,
    batch: RolloutBatch,
    scores: TeacherScores | None,
    token_terms: Callable[[torch.Tensor, TeacherScores], torch.Tensor] | None,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's sampled-token log-probs and the objective's per-token terms (`token_terms(logits,
    scores)`, None when the objective needs only log-probs), directly (`chunk_tokens` 0) or chunked.

    Shapes: -> ([B, Tr] float32, [B, Tr] or None), on the model's device.
    """
    if chunk_tokens == 0:
        logits = response_logits(model, batch)  # [B, Tr, V]
        ids = batch.responses.to(logits.device)
        terms = None if token_terms is None else token_terms(logits, scores)
        return token_logprobs(logits, ids), terms
    hidden, head = response_hidden(model, batch)  # [B, Tr, H]
    ids = batch.responses.to(hidden.device)
    term_fn = None
    if token_terms is not None:

        def term_fn(logits: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            return token_terms(logits, score_tokens(scores, start, stop))

    return chunked_token_terms(hidden, head, ids, chunk_tokens, term_fn)
