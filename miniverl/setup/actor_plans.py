"""One actor's planned GPU memory in its share of the card, from the config and the models' shapes alone (the fit
planner's parts: setup/fit.py puts them on one card, setup/layout.py chooses the shares and the learner's layout
with them).
- learner: weights, the adapter with its AdamW state, and the micro-batch the calibrated peak model
  (models/sizing.py) chooses: what the learner itself will choose after loading;
- scorer: every teacher's weights and the forward size the scorer will choose (models/sizing.py scorer_tokens);
- rollout: vLLM takes its whole share up front (weights, ENGINE_OVERHEAD_GIB, the KV cache: rollout/vllm_settings.py
  memory_plan), and so does SGLang (weights, its graphs and sampler buffers: rollout/sglang.py engine_overhead_bytes,
  the KV pool; its scheduler's CUDA context outside the share); the HF backends hold the weights, a bf16 copy of the
  adapter, the decode cache of every row of the step at full length (data.max_prompt_length +
  rollout.max_new_tokens: the longest a step can ask for) and the sampler's fp32 logits and the prefill's
  activations, calibrated on hf_cached (ROLLOUT_FIXED_BYTES), and the blocks the prefill leaves reserved
  (PREFILL_RESERVED_COPIES): the cap limits reserved memory.
NF4 weights are estimated (models/loading.py NF4_BYTES_PER_PARAM for the decoder's linear layers, the rest in 16
bits). The learner and scorer models are calibrated on the GPU (models/sizing.py); the rollout's model is fitted to
five H200 cells and not yet checked on shapes outside them, and the NF4 estimate not at all, so a plan they put over
its share is reported, not refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from miniverl.config import MiniVerlConfig
from miniverl.errors import ConfigError
from miniverl.models.loading import ModelSize
from miniverl.models.memory import human, kv_bytes_per_token

# The HF rollout (hf_cached) beside its weights, adapter and decode cache, at its peak (the first decode step after
# the prefill): per row the sampler's fp32 [V] logits (ROLLOUT_LOGIT_COPIES of them), per prompt the prefill's
# transient activations (each prompt token's MLP and hidden-size intermediates, PREFILL_TOKEN_BYTES_PER_*; each
# prompt's fp32 attention scores and mask, PREFILL_SCORE_COPIES of [heads + 1, P, P]) and ROLLOUT_FIXED_BYTES.
# Fitted on the H200 to five hf_cached cells of the 0.5B shape (lab/results/fit-planner.md: 128-512 rows,
# 64-600-token prompts, 512 and 1,024 new tokens; each within 0.5%), measured when hf_cached ran every prompt through
# one prefill pass; it now runs passes of PREFILL_TOKENS (rollout/hf_cached.py), which the plan counts, unmeasured.
# Two earlier models missed shapes they were not fitted to by up to 21% and 9%, so this one is reported as an
# estimate until a GPU run checks it on new shapes.
ROLLOUT_LOGIT_COPIES = 1.25
PREFILL_TOKEN_BYTES_PER_INTERMEDIATE = 7.7  # gate, up and their product in 16 bits, x1.29 as fitted
PREFILL_TOKEN_BYTES_PER_HIDDEN = 20.6  # about 10 [P, hidden] 16-bit tensors alive in a layer
PREFILL_SCORE_COPIES = 1.6
# cuBLAS keeps a 32 MiB workspace (Hopper) per stream a GEMM ran on. The fitted cells' rows never stopped: one graph
# width, one or two streams. End to end, hf_cached used to warm up each capture (the gate's, the evaluation's, the
# probes', every width as rows stop) on a new stream: ~0.8 GiB more than this plan (peers.md, 2026-12-06, 0724e28). It
# now captures on one stream, and end to end the 4080 recipe's rollout then peaked at 4.48 GiB allocated against its
# plan of 4.7 (peers.md, 2026-12-06, 3d6a8c6): the intercept holds.
ROLLOUT_FIXED_BYTES = int(0.30 * 2**30)
# What the cap limits is what torch's caching allocator reserves, not what is allocated: the prefill's freed blocks
# stay reserved beside the decode's tensors, which are of other sizes. Reserved peak = allocated peak + the prefill
# once more: the plan is never under the reserved peak of the eight H200 cells with both numbers, at most 5.7% over
# (one pass and passes; lab/results/fit-planner.md "The allocator's reserve"). Without it the 4080 recipe's
# rollout planned 4.7 GiB of its 4.9 GiB share at 322-token prompts and ran out of memory in its first prefill
# (peers.md, 2026-12-06, d0c451a).
PREFILL_RESERVED_COPIES = 1.0
# What nvidia-smi sees of the learner and the scorer is what their caching allocators reserve, not their allocated peak
# (the model above each actor's line): freed blocks of other sizes (micro-batches and forwards of varying length, the
# compiled learner's activations) stay reserved. The seven MOPD cells of 2026-12-06 on an H100 (lab/results/mopd-gpu.md)
# reserved 0.24-0.35 x (allocated peak - weights) more in the learner and 0.25-0.53 x in the scorer; the whole
# card's estimate counts 0.3 x, never past the actor's share (the cap limits reserved memory). Fitted to those seven
# cells: at the prompts they drew it puts the card within 2.1% of nvidia-smi in six (the seventh is the scorer's
# worst-case routing, +11%), where the allocated sum was 1.8-13% under it.
ALLOCATOR_RESERVE = 0.3
ADAPTER_COPY_BYTES = 2  # the rollout's copy of the adapter, in the base's 16-bit dtype
KV_BYTES = 2  # keys and values in the model's 16-bit dtype


@dataclass
class ActorPlan:
    """One actor's plan: its share of the card (the cap it runs under), the weights it holds, its modelled peak,
    what it will choose (a line), and what does not fit (None when it fits)."""

    role: str
    fraction: float
    share_bytes: int
    weight_bytes: int
    peak_bytes: int
    choice: str
    problem: str | None = None
    calibrated: bool = True  # False: arithmetic on shapes, not checked against a measured peak (reported only)
    tokens: int = 0  # the learner's micro-batch or the scorer's forward tokens it will choose (0: none, or not sized)
    # which measured peak the modelled one stands for: torch's "allocated" (learner, scorer), "reserved" (the HF
    # rollouts: the cap limits reserved memory) or "engine" (vLLM's and SGLang's own process, seen by nvidia-smi only)
    measured_as: str = "allocated"
    own_gpu: bool = False  # on a GPU of its own (resources.scorer_gpus > 0): not on the card the others share
    # what its process holds outside torch's allocator besides the CUDA context (vLLM's engine:
    # ENGINE_OUTSIDE_TORCH_GIB): on the card, not in the share the cap limits
    outside_bytes: int = 0

    @property
    def reserved_bytes(self) -> int:
        """What the actor's allocator is expected to hold at its peak, as nvidia-smi counts it: the modelled peak where
        it is already of reserved memory (an HF rollout, an engine's whole share), else that plus ALLOCATOR_RESERVE of
        what it holds beside its weights, at most its share."""
        if self.measured_as != "allocated":
            return self.peak_bytes
        extra = int(ALLOCATOR_RESERVE * max(self.peak_bytes - self.weight_bytes, 0))
        return max(min(self.share_bytes, self.peak_bytes + extra), self.peak_bytes)


def step_rows(cfg: MiniVerlConfig) -> int:
    """Rows of one step on one GPU (each GPU's replicas take a contiguous share of the prompt groups)."""
    return max(cfg.data.prompts_per_step * cfg.rollout.n // max(cfg.resources.gpus or 1, 1), 1)


# The micro-batch past which a larger one buys the learner little (from 16k to 32k tokens it trained only 4% more
# tokens/s: lab/results/learner-throughput.md, 2026-12-01); setup/layout.py sizes the learner's share and chooses
# gradient checkpointing to reach it.
CHECKPOINT_FREE_TOKENS = 16384


def learner_enough_tokens(cfg: MiniVerlConfig) -> int:
    """The micro-batch the learner's layout aims for: trainer.max_tokens_per_micro_batch when set (what the
    micro-batches must hold), else the step's tokens at full length up to CHECKPOINT_FREE_TOKENS."""
    return cfg.trainer.max_tokens_per_micro_batch or min(step_rows(cfg) * cfg.longest_row, CHECKPOINT_FREE_TOKENS)


def teacher_sizes(sizes: dict[str, ModelSize]) -> dict[str, ModelSize]:
    """The teachers' entries of `sizes` (every role but the student's, as setup's paths hold them)."""
    return {role: size for role, size in sizes.items() if role != "student"}


def learner_shape(cfg, size: ModelSize, adapter: int, vocab: int):
    from miniverl.models.loading import torch_dtype
    from miniverl.models.sizing import model_shape

    spec = cfg.model.student
    weights = size.weight_bytes(spec.quantization, torch_dtype(spec.dtype, "cuda").itemsize)
    quantized, compiled = spec.quantization != "none", cfg.trainer.compile_layers is True
    return model_shape(size.config, vocab, weights, adapter, quantized=quantized, compiled=compiled)


def learner_plan(
    cfg, objective, size: ModelSize, adapter: int, vocab: int, share: int, fraction: float, kernels: bool
) -> ActorPlan:
    """`adapter`: the LoRA adapter's parameters (models/lora.py adapter_params)."""
    from miniverl.models.sizing import check_token_budget, fit_tokens, learner_peak_bytes

    spec, t = cfg.model.student, cfg.trainer
    shape = learner_shape(cfg, size, adapter, vocab)
    weights = shape.weight_bytes
    closed = objective.closed_form_head and kernels
    longest_row = cfg.longest_row
    step_tokens = step_rows(cfg) * longest_row
    plan = ActorPlan("learner", fraction, share, weights, 0, "", calibrated=spec.quantization == "none")
    try:
        if t.max_tokens_per_micro_batch:
            tokens = t.max_tokens_per_micro_batch
            check_token_budget(shape, share, tokens, t.logprob_chunk_tokens, t.gradient_checkpointing, closed)
        else:
            tokens = fit_tokens(shape, share, t.logprob_chunk_tokens, t.gradient_checkpointing, longest_row, closed)
    except ConfigError as e:
        plan.problem, tokens = str(e), longest_row
    used = min(tokens, step_tokens)  # a micro-batch never holds more than the step's rows
    plan.peak_bytes = learner_peak_bytes(shape, used, t.logprob_chunk_tokens, t.gradient_checkpointing, closed)
    plan.tokens = tokens if plan.problem is None else 0
    plan.choice = (
        f"micro-batches of up to {tokens:,} tokens (the step: {step_tokens:,} at most)"
        if plan.problem is None
        else f"not one row of {longest_row:,} tokens (the peak shown is that row's)"
    )
    return plan


def scorer_plan(
    cfg, objective, sizes: dict[str, ModelSize], vocab: int, share: int, fraction: float, kernels: bool
) -> ActorPlan:
    from miniverl.models.loading import torch_dtype
    from miniverl.models.sizing import check_scorer_fits, model_shape, scorer_chunk_entry_bytes, scorer_peak_bytes

    if cfg.model.teacher_is_self:  # the learner scores with its adapter off: its share holds it (learner_plan)
        return ActorPlan(
            "scorer", 0.0, 0, 0, 0, "none: the learner scores, its adapter disabled (model.teacher.path=self)"
        )
    specs, t = cfg.model.teacher_roles(), cfg.trainer
    weights = sum(
        sizes[r].weight_bytes(s.quantization, torch_dtype(s.dtype, "cuda").itemsize) for r, s in specs.items()
    )
    entry = scorer_chunk_entry_bytes(objective.teacher_support_k, objective.loss_temperature, vocab, kernels)
    longest_row = cfg.longest_row
    quantized = any(s.quantization != "none" for s in specs.values())
    plan = ActorPlan("scorer", fraction, share, weights, 0, "", calibrated=not quantized)
    shapes = [  # one process holds every teacher
        model_shape(sizes[r].config, vocab, weights, quantized=specs[r].quantization != "none") for r in specs
    ]
    try:
        tokens = min(check_scorer_fits(s, share, t.logprob_chunk_tokens, entry, longest_row) for s in shapes)
        if t.max_tokens_per_micro_batch:
            tokens = min(tokens, t.max_tokens_per_micro_batch)
    except ConfigError as e:
        plan.problem, tokens = str(e), longest_row
    used = min(tokens, step_rows(cfg) * longest_row)
    plan.peak_bytes = max(scorer_peak_bytes(s, used, t.logprob_chunk_tokens, entry) for s in shapes)
    plan.tokens = tokens if plan.problem is None else 0
    plan.choice = (
        f"forwards of up to {tokens:,} tokens"
        if plan.problem is None
        else f"not one row of {longest_row:,} tokens (the peak shown is that row's)"
    )
    return plan


def rollout_plan(cfg, size: ModelSize, adapter: int, share: int, fraction: float) -> ActorPlan:
    """`adapter`: the LoRA adapter's parameters (models/lora.py adapter_params)."""
    from miniverl.models.loading import torch_dtype
    from miniverl.rollout.vllm_settings import ENGINE_OUTSIDE_TORCH_GIB, ENGINE_OVERHEAD_GIB

    spec, r = cfg.model.student, cfg.rollout
    c = size.config
    weights = size.weight_bytes(spec.quantization, torch_dtype(spec.dtype, "cuda").itemsize)
    adapter_bytes = adapter * ADAPTER_COPY_BYTES
    rows = step_rows(cfg)
    columns = cfg.longest_row
    kv_per_token = kv_bytes_per_token(c, KV_BYTES)
    measured_as = "engine" if r.paged_engine else "reserved"
    plan = ActorPlan("rollout", fraction, share, weights, 0, "", calibrated=False, measured_as=measured_as)
    if r.backend == "sglang":  # SGLang's KV pool is what its share leaves beside weights and overhead (memory_plan)
        from miniverl.process import CUDA_CONTEXT_GIB
        from miniverl.rollout.sglang import engine_overhead_bytes

        running = r.sglang.running_rows(r.largest_call(cfg.data))
        overhead = engine_overhead_bytes(running, c.vocab_size)
        kv = share - weights - adapter_bytes - overhead
        plan.peak_bytes = weights + adapter_bytes + overhead + max(kv, 0)
        plan.outside_bytes = int(CUDA_CONTEXT_GIB * 2**30)  # the scheduler's process: a CUDA context of its own
        at_once = max(kv, 0) // kv_per_token // max(columns, 1)
        plan.choice = (
            f"SGLang KV pool {human(max(kv, 0))}: {min(at_once, rows)} of the step's {rows} rows at full length at"
            f" once ({human(overhead)} of engine overhead beside it: its graphs and the sampler's buffers for"
            f" {running} rows decoded at once, measured on an H100 on 2026-12-06: lab/results/sglang-gpu/run3.md; its"
            f" scheduler's CUDA context {human(plan.outside_bytes)} more)"
        )
        if kv <= 0:
            plan.problem = (
                f"SGLang's weights ({human(weights)}), adapter and {human(overhead)} engine overhead (its graphs and"
                f" the sampler's buffers for {running} rows decoded at once) leave nothing for the KV pool in a"
                f" {human(share)} share; raise resources.rollout.num_gpus or lower rollout.sglang.max_running_requests"
            )
        return plan
    if r.backend == "vllm":
        overhead = int(ENGINE_OVERHEAD_GIB * 2**30)
        explicit = r.vllm.kv_cache_gib
        kv = int(explicit * 2**30) if explicit is not None else share - weights - adapter_bytes - overhead
        plan.peak_bytes = weights + adapter_bytes + overhead + max(kv, 0)
        plan.outside_bytes = int(ENGINE_OUTSIDE_TORCH_GIB * 2**30)
        at_once = max(kv, 0) // kv_per_token // max(columns, 1)
        plan.choice = (
            f"vLLM KV cache {human(max(kv, 0))}: {min(at_once, rows)} of the step's {rows} rows at full length at once;"
            f" ~{human(plan.outside_bytes)} more outside torch's allocator (measured)"
        )
        if kv <= 0 or plan.peak_bytes > share:
            plan.problem = (
                f"vLLM's weights ({human(weights)}), adapter and ~{ENGINE_OVERHEAD_GIB} GiB engine overhead leave"
                f" {human(kv) if kv > 0 else 'nothing'} for the KV cache in a {human(share)} share; raise"
                " resources.rollout.num_gpus, set rollout.vllm.kv_cache_gib smaller"
                + (" or quantize the student (model.student.quantization=nf4)" if spec.quantization == "none" else "")
            )
            plan.calibrated = True  # the engine refuses this itself at start (vllm_settings.memory_plan)
        return plan
    from miniverl.rollout.decode_cache import CACHE_COLUMN_QUANTUM

    columns = -(-columns // CACHE_COLUMN_QUANTUM) * CACHE_COLUMN_QUANTUM  # the cache grows in these steps
    p = cfg.data.max_prompt_length
    per_prompt = p * (
        PREFILL_TOKEN_BYTES_PER_INTERMEDIATE * c.intermediate_size + PREFILL_TOKEN_BYTES_PER_HIDDEN * c.hidden_size
    )
    per_prompt += PREFILL_SCORE_COPIES * (c.num_attention_heads + 1) * p * p * 4  # fp32 scores of every head, mask

    def parts(rows: int, prompts: int) -> tuple[int, int, int]:
        """The decode cache, the sampler's logits and the prefill of a generate call of `rows` rows."""
        if r.backend == "hf_cached":  # its prefill goes in passes of at most PREFILL_TOKENS padded tokens
            from miniverl.rollout import hf_cached

            prompts = min(prompts, max(1, hf_cached.PREFILL_TOKENS // max(p, 1)))
        return (
            rows * columns * kv_per_token,
            int(rows * c.vocab_size * 4 * ROLLOUT_LOGIT_COPIES),
            int(prompts * per_prompt),
        )

    # a step's rows, or the evaluation's (data.eval_prompts greedy rows, one per prompt) when they are more
    eval_rows = -(-cfg.data.eval_prompts // max(cfg.resources.gpus or 1, 1))
    calls = [parts(rows, -(-rows // r.n)), parts(eval_rows, eval_rows)]
    cache, logits, prefill = max(calls, key=sum)
    held = int(PREFILL_RESERVED_COPIES * prefill)
    plan.peak_bytes = weights + adapter_bytes + ROLLOUT_FIXED_BYTES + cache + logits + prefill + held
    widest = rows if (cache, logits, prefill) == calls[0] else eval_rows
    plan.choice = (
        f"decode cache {widest} rows x {columns:,} tokens = {human(cache)}, sampler logits {human(logits)},"
        f" prefill {human(prefill)} (+{human(held)} its freed blocks keep reserved)"
        + ("" if widest == rows else " (the evaluation's rows: more than a step's)")
    )
    if plan.peak_bytes > share:
        fixes = [
            "fewer rows (data.prompts_per_step, rollout.n" + (", data.eval_prompts)" if widest != rows else ")"),
            "shorter ones (data.max_prompt_length, rollout.max_new_tokens)",
            "a larger resources.rollout.num_gpus",
            *(["an NF4 student"] if spec.quantization == "none" else []),
        ]
        plan.problem = (
            f"the {r.backend} rollout's weights, adapter copy, decode cache, sampler logits and prefill come to"
            f" {human(plan.peak_bytes)}, over its {human(share)} share; {', '.join(fixes[:-1])} or {fixes[-1]}"
        )
    return plan
