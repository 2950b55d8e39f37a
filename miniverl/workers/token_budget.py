"""The learner's micro-batch token budget on a GPU: sized once from its memory share by the calibrated peak model
(models/sizing.py), and lowered for the rest of the run when an update runs out of memory anyway.

The budget is the most padded tokens one micro-batch of an update holds (trainer.max_tokens_per_micro_batch;
0: micro-batches counted in rows, trainer.micro_batch_size). The learner (workers/learner.py) keeps it and
redoes an out-of-memory update at the lowered one.
"""

from __future__ import annotations

from miniverl.errors import MiniVerlError
from miniverl.process import ProcessSettings, memory_share_bytes, release_cached_memory

# How much an out-of-memory update lowers the token budget before it is redone (shrink_after_oom).
OOM_SHRINK = 0.75


def learner_shape(model, compiled: bool = False):
    """The peak-memory model's view of a loaded peft student (models/sizing.py); `compiled`: its decoder layers
    run compiled."""
    from miniverl.models.sizing import model_shape

    config = model.get_base_model().config
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model_shape(config, config.vocab_size, frozen, trainable, compiled=compiled)


def size_micro_batches(
    model,
    process: ProcessSettings,
    tokens: int,
    chunk_tokens: int,
    checkpointing: bool,
    longest_row: int,
    closed_form_head: bool,
    compiled: bool = False,
) -> int:
    """The token budget per micro-batch of `model`'s updates on a GPU: `tokens` (trainer.max_tokens_per_micro_batch)
    checked against the process's memory share when set, else the largest the share holds for rows of up to
    `longest_row` tokens; the choice is printed with its numbers. `chunk_tokens` (trainer.logprob_chunk_tokens),
    `checkpointing` (trainer.gradient_checkpointing), `compiled` (trainer.compile_layers) and the objective's
    `closed_form_head` shape the peak."""
    from miniverl.models.memory import human
    from miniverl.models.sizing import check_token_budget, fit_tokens, learner_peak_bytes
    from miniverl.models.vocab_kernels import kernels_available

    shape = learner_shape(model, compiled)
    share = memory_share_bytes(process)
    # the chunk holds only bf16 logits on the closed-form path with the Triton passes (models/sizing.py)
    closed = closed_form_head and kernels_available()
    if tokens:
        check_token_budget(shape, share, tokens, chunk_tokens, checkpointing, closed)
        return tokens
    tokens = fit_tokens(shape, share, chunk_tokens, checkpointing, max(longest_row, 1), closed)
    peak = learner_peak_bytes(shape, tokens, chunk_tokens, checkpointing, closed)
    print(
        f"learner: micro-batches of up to {tokens} tokens (trainer.max_tokens_per_micro_batch=0), modelled peak"
        f" {human(peak)} of a {human(share)} share",
        flush=True,
    )
    return tokens


def shrink_after_oom(tokens: int, world_size: int, longest_row: int, error: str, device: str) -> int:
    """The budget to redo an update at after it ran out of memory at `tokens` (its partial gradients already
    dropped): OOM_SHRINK of it, for this and every later step, said so, with the cache given back. The memory
    model sizes the budget from measured peaks, but the caching allocator's fragmentation depends on what ran
    before (the 4080 recipe's first update went out of memory at 3.3 GiB allocated with 0.76 GiB reserved in
    holes, lab/results/qlora-4080.md). Raises MiniVerlError (quoting CUDA's `error`) when the budget cannot
    shrink: fixed rows (no token budget), several ranks (the others would wait in the gradient sum), or below
    the batch's `longest_row`."""
    smaller = int(tokens * OOM_SHRINK)
    if tokens <= 0 or world_size > 1 or smaller < longest_row:
        why = f"the longest row has {longest_row} tokens"
        if tokens <= 0:
            why = "micro-batches are counted in rows (trainer.micro_batch_size), not tokens"
        elif world_size > 1:
            why = "several ranks: the others would wait in the gradient sum"
        raise MiniVerlError(
            f"the learner ran out of GPU memory in its update at micro-batches of {tokens} tokens and"
            f" cannot shrink them ({why}); the update was not applied. Give the learner a larger"
            f" resources.learner.num_gpus share, lower trainer.max_tokens_per_micro_batch or"
            f" trainer.logprob_chunk_tokens, or shorten rollout.max_new_tokens. CUDA said: {error[:300]}"
        )
    release_cached_memory(device)
    print(
        f"learner: out of GPU memory at micro-batches of {tokens} tokens; redoing this update at"
        f" {smaller} tokens, kept for the rest of the run",
        flush=True,
    )
    return smaller
