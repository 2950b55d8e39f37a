"""How many tokens one learner micro-batch may hold in a memory share: a peak-memory model calibrated on the GPU.

The learner's peak is whichever of its two phases is larger (gradient checkpointing on, fused LM-head loss):
- the loss phase: the checkpointed layer inputs of every token ([T, H] bf16 per layer) and one LM-head chunk's
  vocabulary buffers: the bf16 logits alone on the closed-form path with the Triton passes (models/fused_head.py,
  models/vocab_kernels.py), fp32 copies when the loss runs autograd over the chunk (models/memory.py);
- the backward phase: the same checkpoints plus one decoder layer's recomputed activations for every token
  (attention and MLP intermediates, the LoRA terms in the base's dtype).
Both sit on the fixed part: weights, the adapter with its gradient and two AdamW moments, and a little runtime.
Measured on the H200 (0.5B shape, LoRA r32 on every linear layer, GKD top-64, 640-token rows, 2026-12-02,
bf16 LoRA arithmetic and the Triton passes; lab/results/learner-throughput.md): 3.02 GiB at 16,384
tokens and 4.86 GiB at 32,768, with 512- and 1,024-token chunks alike (the backward phase is the peak), a slope
of 120 KB per token (43 KB of checkpoints, so one layer's recomputed activations take 77 KB: 13.4 bytes per unit
of hidden + intermediate size) and an intercept equal to weights + adapter state. (The fp32 LoRA arithmetic it
replaced measured 128 KB per token and 0.5 GB more.) Without checkpointing every layer's activations stay
(about 1.75 MB per token measured with the fp32 LoRA arithmetic; 8,192 tokens peaked at 19.2 GiB). Compiled decoder
layers (trainer.compile_layers) keep more of a layer's intermediates for its backward: 3.71 against 3.29 GiB at
17,751 tokens (learner-throughput.md, 2026-12-03, efc4eff), counted here as 4.4 more bytes per unit of width per token.

Everything here is arithmetic on plain numbers, so it is tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from miniverl.errors import ConfigError
from miniverl.models.memory import CLOSED_FORM_CHUNK_BYTES_PER_ENTRY, FP32_BYTES, chunk_entry_bytes, human

# One decoder layer's recomputed activations per token, in bytes per unit of (hidden + intermediate) size.
LAYER_ACTIVATION_BYTES_PER_WIDTH = 13.4
# What compiled layers add to it: Inductor's partition saves other intermediates than eager's autograd. One H200
# measurement (0.5B shape, 17,751 tokens: +0.42 GiB, 25 KB a token over 896 + 4,864 of width); counted per token, so
# larger micro-batches get the larger margin. Without it the gkd_4080 learner (4.1 GiB share) planned 17,322-token
# micro-batches and its first compiled update went out of memory every time (lab/results/peers.md, 2026-12-05, 6c8e93b).
COMPILED_LAYER_EXTRA_BYTES_PER_WIDTH = 4.4
# Beyond weights and adapter state (cuBLAS workspaces, small tensors): the measured intercept was within 1 MB of
# weights + adapter state; this keeps a margin for what a longer run allocates besides.
RUNTIME_BYTES = 128 * 2**20

CHECKPOINT_BYTES = 2  # each layer's input is kept in the model's 16-bit dtype
# Per adapter parameter: the fp32 weight, its gradient and AdamW's two moments (16), and while an update runs the
# bf16 copy its forwards use and that copy's gradient (4: models/lora.py RoundedAdapter).
ADAPTER_STATE_BYTES = 20
# Allocator fragmentation, the CUDA caching allocator's rounding and small tensors: a share of the budget
# kept free. 15% was enough in the bench (reserved 10% above allocated at 32,768 tokens) but not in the 4080
# recipe, whose learner runs probes and evaluation between updates: its first update went out of memory with
# 0.76 GiB (18% of its 4.14 GiB share) reserved in holes (lab/results/qlora-4080.md, 2026-12-02). 20% with the
# learner's shrink-and-redo on an out-of-memory update (workers/learner.py redoes it, workers/token_budget.py
# shrink_after_oom sizes it) as the backstop.
SLACK_FRACTION = 0.20


@dataclass(frozen=True)
class LearnerShape:
    """What the peak-memory model needs of the student: its sizes and the bytes it holds before training."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    weight_bytes: int  # the base model as loaded (bf16 or NF4)
    adapter_params: int
    quantized: bool = False  # loaded in 4 bits already: a refusal does not offer quantization as the fix
    compiled: bool = False  # its decoder layers run through torch.compile (trainer.compile_layers)


def model_shape(
    config,
    vocab: int,
    weight_bytes: int,
    adapter_params: int = 0,
    quantized: bool | None = None,
    compiled: bool = False,
) -> LearnerShape:
    """A model as the memory models see it: the sizes in its transformers `config`, the logits it is scored over
    (`vocab`), the bytes its weights take as loaded and its adapter's parameters (a teacher has none); `quantized`
    defaults to whether the config says it was loaded quantized (transformers' `quantization_config`); `compiled`:
    the learner compiles its decoder layers."""
    return LearnerShape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        vocab=vocab,
        weight_bytes=weight_bytes,
        adapter_params=adapter_params,
        quantized=getattr(config, "quantization_config", None) is not None if quantized is None else quantized,
        compiled=compiled,
    )


# A no-gradient forward keeps only one layer's transient activations per token (the MLP's gate, up and product,
# [T, intermediate] in bf16: about 6 bytes per unit of hidden + intermediate size). An estimate from the shapes,
# checked once against a measured peak (scorer_tokens).
SCORER_LAYER_BYTES_PER_WIDTH = 6.0
# fp32 [c, V] buffers of one scoring chunk at a loss temperature other than 1 or with a full support (no backward):
# the upcast and divided logits, the log-softmax, the previous chunk's log-softmax until it is replaced, and the
# tail's scatter beside the logsumexp's temporary; with the chunk's bf16 logits about 14 bytes per logit at the peak.
SCORER_CHUNK_FP32_COPIES = 4


def scorer_chunk_entry_bytes(support_k: int | None, loss_temperature: float, vocab: int, kernels: bool) -> int:
    """Bytes per [c, V] entry of one scoring chunk (workers/scorer.py). The chunk stays in the model's dtype,
    worked on in place by the Triton passes (`kernels`: models/vocab_kernels.py), when the scorer returns the
    sampled tokens' log-probs alone (`support_k` None: PG-k1, evaluation) or a top-K support at loss temperature
    1: counted like the learner's closed-form chunk. A full support, another temperature or the torch fallback
    make fp32 copies of it. Counting fp32 copies for the model-dtype path too left the 4080 recipe's teacher
    no room at 1,024-token chunks: it scored one row per forward, 8.5 s a step where 4,388-token forwards had
    taken 2.1 (lab/results/qlora-4080.md, the H200 cells of 2026-12-02)."""
    in_model_dtype = support_k is None or (0 < support_k < vocab and loss_temperature == 1.0)
    if in_model_dtype and kernels:
        return CLOSED_FORM_CHUNK_BYTES_PER_ENTRY
    return FP32_BYTES * SCORER_CHUNK_FP32_COPIES


def scorer_tokens(
    shape: LearnerShape, share_bytes: int, chunk_tokens: int, entry_bytes: int = FP32_BYTES * SCORER_CHUNK_FP32_COPIES
) -> int:
    """Tokens per teacher forward (no gradient): the final hidden states of every token stay for the LM-head
    chunks, and one layer's activations exist at a time; the weights are fixed. `entry_bytes`: one chunk entry
    (scorer_chunk_entry_bytes). 0 when nothing fits."""
    usable, per_token, chunk = _scorer_costs(shape, share_bytes, chunk_tokens, entry_bytes)
    return max(int((usable - chunk) // per_token), 0)


def scorer_peak_bytes(shape: LearnerShape, tokens: int, chunk_tokens: int, entry_bytes: int) -> int:
    """Modelled peak of one teacher forward of `tokens` tokens (slack not included): the weights, the per-token
    activations and one LM-head chunk, as scorer_tokens counts them."""
    _, per_token, chunk = _scorer_costs(shape, 0, chunk_tokens, entry_bytes)
    return int(shape.weight_bytes + tokens * per_token + chunk)


def _scorer_costs(shape: LearnerShape, share_bytes: int, chunk_tokens: int, entry_bytes: int):
    """(bytes the share leaves beside the weights, bytes per token of a forward, bytes of one LM-head chunk)."""
    # Weights only: in the recipe's end-to-end run (lab/results/qlora-4080.md) the 1.5B teacher peaked at
    # 3.52 GiB with 4,388-token forwards and 256-token fp32 chunks, which weights + this per-token model + one
    # chunk give within 2% without the learner's runtime intercept (no backward, no optimizer).
    usable = share_bytes * (1 - SLACK_FRACTION) - shape.weight_bytes
    per_token = shape.hidden * CHECKPOINT_BYTES + SCORER_LAYER_BYTES_PER_WIDTH * (shape.hidden + shape.intermediate)
    chunk = max(chunk_tokens, 0) * shape.vocab * entry_bytes
    if chunk_tokens <= 0:  # a whole micro-batch's logits at once: they cost per token too
        per_token += shape.vocab * entry_bytes
    return usable, per_token, chunk


def check_scorer_fits(
    shape: LearnerShape, share_bytes: int, chunk_tokens: int, entry_bytes: int, longest_row: int
) -> int:
    """scorer_tokens, refused with the arithmetic when one row of `longest_row` tokens does not fit: a teacher
    scoring a row at a time would run out of memory, or crawl where the row just fits beside a chunk."""
    fits = scorer_tokens(shape, share_bytes, chunk_tokens, entry_bytes)
    row = max(longest_row, 1)
    if fits >= row:
        return fits
    usable, per_token, chunk = _scorer_costs(shape, share_bytes, chunk_tokens, entry_bytes)
    head = f"the teacher scorer's memory share of {human(share_bytes)} cannot hold one row of {row} tokens"
    share_fixes = "give the scorer a larger resources.scorer.num_gpus share" + (
        "" if shape.quantized else " or quantize the teacher (model.teacher.quantization=nf4)"
    )
    if usable <= 0:
        raise ConfigError(
            f"{head}: {human(shape.weight_bytes)} of teacher weights alone exceed it less {SLACK_FRACTION:.0%} slack;"
            f" {share_fixes}"
        )
    if chunk_tokens > 0:
        logits = f"one LM-head chunk of {chunk_tokens} tokens x {shape.vocab} x {entry_bytes} B takes {human(chunk)}"
        fix = "lower trainer.logprob_chunk_tokens"
    else:
        logits = f"with trainer.logprob_chunk_tokens=0 every token's logits cost {shape.vocab} x {entry_bytes} B too"
        fix = "set trainer.logprob_chunk_tokens (e.g. 256)"
    raise ConfigError(
        f"{head}: less {SLACK_FRACTION:.0%} slack and {human(shape.weight_bytes)} of teacher weights it leaves"
        f" {human(int(usable))}; {logits}, and the row's activations need {row} x {human(int(per_token))}"
        f" = {human(int(row * per_token))}; {fix}, {share_fixes}, or shorten"
        " rollout.max_new_tokens or data.max_prompt_length"
    )


def fixed_bytes(shape: LearnerShape) -> int:
    return shape.weight_bytes + shape.adapter_params * ADAPTER_STATE_BYTES + RUNTIME_BYTES


def per_token_bytes(shape: LearnerShape, checkpointing: bool) -> tuple[float, float]:
    """(loss phase, backward phase) bytes per token of a micro-batch."""
    checkpoints = shape.layers * shape.hidden * CHECKPOINT_BYTES
    per_width = LAYER_ACTIVATION_BYTES_PER_WIDTH + (COMPILED_LAYER_EXTRA_BYTES_PER_WIDTH if shape.compiled else 0.0)
    layer = per_width * (shape.hidden + shape.intermediate)
    if not checkpointing:
        return shape.layers * layer, shape.layers * layer
    return checkpoints, checkpoints + layer


def learner_peak_bytes(
    shape: LearnerShape, tokens: int, chunk_tokens: int, checkpointing: bool, closed_form: bool = False
) -> int:
    """Modelled peak of one update with `tokens` padded tokens per micro-batch (slack not included);
    `closed_form`: the LM-head chunk's buffers as `chunk_entry_bytes` counts them."""
    loss_phase, backward_phase = per_token_bytes(shape, checkpointing)
    chunk = min(chunk_tokens, tokens) if chunk_tokens > 0 else tokens
    vocab = chunk * shape.vocab * chunk_entry_bytes(closed_form)
    return fixed_bytes(shape) + int(max(loss_phase * tokens + vocab, backward_phase * tokens))


def fit_tokens(
    shape: LearnerShape,
    share_bytes: int,
    chunk_tokens: int,
    checkpointing: bool,
    longest_row: int,
    closed_form: bool = False,
) -> int:
    """The largest micro-batch token budget whose modelled peak stays inside `share_bytes` less the slack.

    Raises ConfigError with the arithmetic when not even one row of `longest_row` tokens fits.
    """
    usable = share_bytes * (1 - SLACK_FRACTION)
    lo, hi = 0, 1 << 22
    while lo < hi:  # the peak grows with tokens: binary search for the last budget that fits
        mid = (lo + hi + 1) // 2
        if learner_peak_bytes(shape, mid, chunk_tokens, checkpointing, closed_form) <= usable:
            lo = mid
        else:
            hi = mid - 1
    if lo < longest_row:
        need = learner_peak_bytes(shape, longest_row, chunk_tokens, checkpointing, closed_form)
        raise ConfigError(
            f"the learner's memory share of {human(share_bytes)} cannot hold one row of {longest_row} tokens:"
            f" weights and adapter state take {human(fixed_bytes(shape))}, one row's activations and LM-head chunk"
            f" bring the modelled peak to {human(need)} (plus {SLACK_FRACTION:.0%} slack); give the learner a"
            " larger resources share, "
            + ("" if checkpointing else "turn on trainer.gradient_checkpointing, ")
            + "lower trainer.logprob_chunk_tokens, rollout.max_new_tokens or data.max_prompt_length"
            + ("" if shape.quantized else ", or quantize the student (model.student.quantization=nf4)")
        )
    return lo


def check_token_budget(
    shape: LearnerShape,
    share_bytes: int,
    tokens: int,
    chunk_tokens: int,
    checkpointing: bool,
    closed_form: bool = False,
) -> None:
    """Refuse an explicit trainer.max_tokens_per_micro_batch whose modelled peak exceeds the share, with the
    arithmetic and the budget that would fit."""
    peak = learner_peak_bytes(shape, tokens, chunk_tokens, checkpointing, closed_form)
    if peak > share_bytes * (1 - SLACK_FRACTION):
        best = fit_tokens(shape, share_bytes, chunk_tokens, checkpointing, 1, closed_form)
        _, backward_phase = per_token_bytes(shape, checkpointing)
        raise ConfigError(
            f"trainer.max_tokens_per_micro_batch={tokens} would peak the learner at about {human(peak)}: weights and"
            f" adapter state {human(fixed_bytes(shape))} + {tokens} tokens x {backward_phase / 1024:.0f} KiB of"
            f" activations (gradient_checkpointing={str(checkpointing).lower()}), over its share of"
            f" {human(share_bytes)} less {SLACK_FRACTION:.0%} slack; use at most {best} tokens, or 0 to size it"
            " from the share"
        )
