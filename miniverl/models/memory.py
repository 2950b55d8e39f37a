"""How many bytes the vocabulary-sized tensors of a run take, as pure functions, and the refusal that uses them.

At a 152k vocabulary these tensors, not the models, decide whether a step fits a 16 GB card (DESIGN.md:
the learner peaked at 17 GiB holding fp32 log-softmax for 16 rows; the scorer's full support of a step
is rows x tokens x V x 4 bytes). Everything here is arithmetic on plain numbers, so it is tested without
a model.
"""

from __future__ import annotations

from miniverl.errors import ConfigError

GIB = 2**30
FP32_BYTES = 4
ID_BYTES = 4  # teacher_topk_ids travel as int32 (the scorer casts torch.topk's int64 index: workers/scorer.py)
# Vocabulary-sized fp32 buffers alive at once while the fused LM-head loss works on one chunk (upcast logits,
# log-softmax and logsumexp inputs, the top-K support arithmetic, the chunk's own backward): measured on the
# H200 at 5.9 for GKD top-64 (0.5B shape, 1,024-token chunks: 3.7 GB above the model, adapter, optimizer and
# checkpoints; lab/results/learner-throughput.md), rounded up. The earlier chunked path kept about nine.
FUSED_CHUNK_FP32_COPIES = 6
# One [c, V] entry of an LM-head chunk on the closed-form path (GKD top-K at loss temperature 1, PG-k1) with the
# Triton passes: the bf16 logits, overwritten in place by their gradient (2 bytes), doubled for the GEMM's output
# while the previous chunk's buffer is being freed. Measured: 512- and 1,024-token chunks peak the same
# (lab/results/learner-throughput.md, 2026-12-02), so this is an upper bound the measurements do not pin down.
CLOSED_FORM_CHUNK_BYTES_PER_ENTRY = 4


def chunk_entry_bytes(closed_form: bool) -> int:
    """Bytes per [c, V] entry of one LM-head chunk: the closed-form path (with the Triton passes) or autograd
    over the chunk (fp32 copies: full-vocabulary GKD, a loss temperature other than 1)."""
    return CLOSED_FORM_CHUNK_BYTES_PER_ENTRY if closed_form else FP32_BYTES * FUSED_CHUNK_FP32_COPIES


def kv_bytes_per_token(config, itemsize: int = 2) -> int:
    """Bytes one token's keys and values take over every layer of a transformers `config` (16-bit by default): what
    an engine's KV pool holds per token."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def human(n: int) -> str:
    """Bytes as GiB with one decimal, or MiB/KiB when smaller (so a message never reads 0.0 GiB)."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if n >= size / 10:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def teacher_support_bytes(rows: int, tokens: int, vocab: int, topk: int | None) -> int:
    """Bytes of one step's teacher scores (scorer -> learner): the sampled-token log-probs, plus the
    full distribution (`topk` 0: rows x tokens x vocab fp32) or the top-K log-probs, ids and tail mass."""
    sampled = rows * tokens * FP32_BYTES
    if topk is None:
        return sampled
    if topk == 0 or topk >= vocab:
        return sampled + rows * tokens * vocab * FP32_BYTES
    return sampled + rows * tokens * (topk * (FP32_BYTES + ID_BYTES) + FP32_BYTES)


def chunk_positions(micro_batch: int, tokens: int, chunk_tokens: int, max_tokens: int = 0) -> int:
    """Response tokens whose logits exist at once: `chunk_tokens`, or a whole micro-batch's response tokens
    when it is 0 (`max_tokens` padded tokens when set, else `micro_batch` rows of `tokens`), whichever is less."""
    whole = max_tokens if max_tokens > 0 else micro_batch * tokens
    return whole if chunk_tokens == 0 else min(chunk_tokens, whole)


def learner_logits_bytes(
    micro_batch: int, tokens: int, vocab: int, chunk_tokens: int, max_tokens: int = 0, closed_form: bool = False
) -> int:
    """Peak bytes of the learner's vocabulary-sized buffers: one chunk of the fused LM-head loss."""
    return chunk_positions(micro_batch, tokens, chunk_tokens, max_tokens) * vocab * chunk_entry_bytes(closed_form)


def check_vocab_memory(
    rows: int,
    tokens: int,
    vocab: int,
    topk: int | None,
    micro_batch: int,
    chunk_tokens: int,
    budget_gib: float,
    max_tokens: int = 0,
    closed_form: bool = False,
) -> None:
    """Refuse a run whose vocabulary-sized tensors exceed `budget_gib`, showing the arithmetic and the fixes.

    rows: rollout rows per step (prompts x samples); tokens: rollout.max_new_tokens; vocab: logits compared;
    closed_form: the objective's loss takes the fused head's closed-form path (`chunk_entry_bytes`).
    """
    support = teacher_support_bytes(rows, tokens, vocab, topk)
    if support > budget_gib * GIB:
        per_token = (
            f"{vocab} x {FP32_BYTES} B (full vocabulary)"
            if topk == 0 or (topk is not None and topk >= vocab)
            else f"{topk} x {FP32_BYTES + ID_BYTES} B + {FP32_BYTES} B (top-{topk} + tail)"
        )
        raise ConfigError(
            f"the teacher's support of one step would take {human(support)}: {rows} rows x {tokens} tokens x"
            f" {per_token} per token, over trainer.vocab_memory_budget_gib={budget_gib:g}; set objective.teacher_topk"
            " to a support size such as 64 (NeMo RL's K), or lower data.prompts_per_step, rollout.n or"
            " rollout.max_new_tokens"
        )
    logits = learner_logits_bytes(micro_batch, tokens, vocab, chunk_tokens, max_tokens, closed_form)
    if logits > budget_gib * GIB:
        positions = chunk_positions(micro_batch, tokens, chunk_tokens, max_tokens)
        raise ConfigError(
            f"the learner's logits would take {human(logits)} at once: {positions} response tokens x {vocab} x"
            f" {chunk_entry_bytes(closed_form)} B of buffers per entry of an LM-head chunk, over"
            f" trainer.vocab_memory_budget_gib={budget_gib:g}; set trainer.logprob_chunk_tokens to a chunk such"
            " as 256 (0 = a whole micro-batch at once), or lower trainer.max_tokens_per_micro_batch"
        )
