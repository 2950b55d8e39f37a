"""The SGLang rollout backend: SGLang's Engine inside the rollout actor, token ids in and out (issue 37).

Written against sglang 0.5.17, the newest release whose pins match the GPU machine's torch 2.11
(lab/results/sglang-feasibility.md), from its source. On the H200 (lab/results/sglang-gpu/run1.md, 2026-12-05) its
engine imports and starts only with the registration shim below, and honours `sampling_seed` only with deterministic
inference on. On an H100 its GPU tests pass (run3.md, run5.md: the oracle, row seeds, the probe after every refresh, a
stale replica caught), it samples the policy's law 2.5-3.3x slower than hf_cached with realistic prompts (about as
fast as tuned vLLM at 256 x 4) and runs the 4080 recipe end to end (52 refreshes at 14.55 GiB, gate passed:
lab/results/sglang-gpu/run4.md, run5.md). What it relies on:
- `Engine(skip_tokenizer_init=True)`: token ids in (`input_ids`), token ids out (`output_ids`), stopping on
  `stop_token_ids` only;
- `SGLANG_RETURN_ORIGINAL_LOGPROB=1` (set before SGLang is imported): `return_logprob=True` gives each sampled
  token's log-prob before temperature, top-k and top-p, the untempered policy's, which is what
  RolloutBatch.rollout_log_probs means;
- one request per row, seeded by its row seed (`sampling_seed`), as vLLM's `seeding=row`. SGLang reads the seed only
  with `enable_deterministic_inference=True` (sampling_batch_info.py; without it the first run, sglang-gpu/run1.md, drew
  other tokens for the same seed), which also fixes its sampler to the pytorch one: a draw from (seed, position);
- sglang_compat/sitecustomize.py in every engine process: sglang 0.5.17 re-registers model types transformers 5.17
  already has, which transformers refuses (run1.md: the scheduler died at import); with SglangSettings.batch_invariant
  false (a run's: sglang-gpu/run3.md measured it as exact and 1.1-1.2x faster) it keeps the batch-invariant kernels
  that deterministic inference switches on out of the engine; on an emulated card it caps the scheduler's allocator at
  the actor's budget, as every actor process is capped;
- every policy version is a new adapter loaded from the learner's tensors under a new name
  (`load_lora_adapter_from_tensors`), the previous one unloaded; the radix cache keys its entries by adapter, and
  `flush_cache()` empties it at every refresh (SGLang flushes only when no request is in flight: a refresh comes
  between generate calls, and a refused flush stops the run);
- SGLang's static fraction is of the memory free when its scheduler starts, not of the device: the KV pool is sized
  here from the actor's share (memory_plan: SGLang's max_total_tokens), as the fit planner plans it;
- SGLang's LoRA buffers are its own copies, so `served_digest` is None and every refresh is proven by the probe
  (`probe_logprobs`: the prompt's log-probs with `logprob_start_len=0`), as for vLLM.
Importing this module imports no SGLang; constructing the backend does.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from miniverl.errors import ConfigError
from miniverl.models.loading import load_model_config, model_size
from miniverl.models.lora import LoraSettings, adapter_template
from miniverl.models.memory import kv_bytes_per_token
from miniverl.rollout import Completion
from miniverl.rollout.sampling import SamplingParams
from miniverl.served_policy import probe_tolerance

# What the engine's scheduler process holds in torch's allocator beside its static fraction (weights, LoRA pool and KV
# pool), from sglang 0.5.17's source and the per-process trace of lab/results/sglang-gpu/run3.md (2026-12-06, H100, the
# 0.5B-shaped student, 256 rows, a 2,048-token prefill chunk):
# - SGLANG_GRAPHS_GIB: decode and prefill CUDA graphs and the buffers made at start: the process read 4,754 MiB once
#   started, less one CUDA context (0.66 GiB), the shared [rows, V] fp32 output buffer (0.14 GiB) and the static
#   part, which run3.md did not record: its fraction (0.041) of what was free when the scheduler started, 3.0-3.3 GiB
#   (the learner's and scorer's weights were loading beside it): 0.55-0.8 GiB, the larger taken;
# - ROW_LOGIT_BYTES per row decoded at once and vocabulary entry: the deterministic pytorch sampler's temporaries (28:
#   fp32 log-softmax of the original logits, softmax, log, a uint32 hash and an fp64 pair: layers/sampler.py), the
#   shared fp32 output buffer (4) and the batch the overlap scheduler keeps (4): 1.30 GiB at 256 rows and Qwen2.5's
#   151,936 tokens;
# - the prompt log-probs of a probe or of a retracted request's re-prefill, computed LOGPROB_CHUNK_TOKENS rows at a
#   time (bf16 logits, fp32 log-softmax and gather: LOGPROB_TOKEN_BYTES each); SGLang's own chunk is 2,048 (2.9 GiB).
# run3.md's engine, sized by the earlier model (a prefill chunk's fp32 logits: 1.66 GiB), read 7,928 MiB at its peak
# against a 4.94 GiB share: the sampler's blocks of different row counts kept by an allocator nothing capped. The
# backend now caps the scheduler's allocator at the actor's budget where the card is emulated (sglang_compat: the
# other actors' processes are capped the same way) and bounds the prompt log-probs' chunk (SGLANG_LOGPROB_CHUNK_SIZE).
SGLANG_GRAPHS_GIB = 0.8
ROW_LOGIT_BYTES = 36
LOGPROB_CHUNK_TOKENS = 256
LOGPROB_TOKEN_BYTES = 10
# SGLang's static fraction when the backend sizes the KV pool itself (memory_plan): high, so that SGLang's own
# profile of the free memory leaves at least the planned pool
PROFILE_FRACTION = 0.9
# Deterministic inference (row seeds need it) also swaps cuBLAS for SGLang's batch-invariant Triton kernels; a run keeps
# them out (the shim below) and SGLang's usual kernels: as exact on the oracle and the gate, and 1.13-1.24x the
# tokens/s (lab/results/sglang-gpu/run3.md). With them a row's tokens would not depend on the batch it shares; until
# 2026-12-07 the key rollout.sglang.batch_invariant, now SglangSettings.batch_invariant, which a bench may set.
BATCH_INVARIANT = False
# SglangSettings.batch_invariant and the allocator cap for sglang_compat/sitecustomize.py, which runs in every engine
# process (and holds the same names: importing it here would patch transformers at import)
BATCH_INVARIANT_ENV = "MINIVERL_SGLANG_BATCH_INVARIANT"
MEMORY_CAP_ENV = "MINIVERL_SGLANG_MEMORY_CAP_BYTES"


def engine_overhead_bytes(rows: int, vocab_size: int) -> int:
    """The engine's allocator beside its static fraction with `rows` decoded at once (the comment above)."""
    graphs = int(SGLANG_GRAPHS_GIB * 2**30)
    return graphs + rows * vocab_size * ROW_LOGIT_BYTES + LOGPROB_CHUNK_TOKENS * vocab_size * LOGPROB_TOKEN_BYTES


@dataclass(frozen=True)
class SglangSettings:
    """What the engine is started with: rollout.sglang plus the sizes the rest of the run implies."""

    attention_backend: str
    mem_fraction_static: float | None  # null: the KV pool sized from the share (memory_plan)
    chunked_prefill_size: int  # tokens in one prefill chunk
    batch_invariant: bool  # SGLang's batch-invariant kernels, which deterministic inference switches on
    max_running_requests: int  # rows decoded at once: the run's largest call, or rollout.sglang's smaller bound
    context_length: int  # data.max_prompt_length + rollout.max_new_tokens
    gpu_share: float  # the rollout actor's Ray share of its GPU
    gpu_cap_gib: float | None  # its emulated cap (resources.emulate_gpu_gib), or None


def settings_from_config(cfg, gpu_share: float, gpu_cap_gib: float | None, largest_call: int) -> SglangSettings:
    """The builder (the one place reading config): `rollout.sglang`, the actor's share of the GPU and its cap, and the
    rows of the run's largest generate call (RolloutConfig.largest_call: rollout.vllm.max_num_seqs is vLLM's knob,
    not SGLang's), or rollout.sglang.max_running_requests where it is smaller. The values are validate's to check
    (config/rollout.py)."""
    s = cfg.rollout.sglang
    return SglangSettings(
        attention_backend=s.attention_backend,
        mem_fraction_static=s.mem_fraction_static,
        chunked_prefill_size=s.chunked_prefill_size,
        batch_invariant=BATCH_INVARIANT,
        max_running_requests=s.running_rows(largest_call),
        context_length=cfg.longest_row,
        gpu_share=gpu_share,
        gpu_cap_gib=gpu_cap_gib,
    )


def memory_plan(
    settings: SglangSettings,
    total_bytes: int,
    vocab_size: int,
    weight_bytes: int,
    adapter_bytes: int,
    kv_per_token: int,
) -> tuple[float, int | None]:
    """(mem_fraction_static, max_total_tokens or None) for the engine. SGLang's static fraction is of the memory
    free when its scheduler starts (kv_cache_configurator.py: the KV pool is what is free after the weights less
    (1 - fraction) x what was free before them), so on a card the learner and scorer already use a fraction of the
    device sizes nothing: the KV pool is sized here instead, as the fit planner plans it (setup/actor_plans.py):
    the actor's budget less the weights, the adapter and engine_overhead_bytes, in tokens (SGLang's
    max_total_tokens, an upper bound), with a static fraction of PROFILE_FRACTION so its own profile never binds
    first. rollout.sglang.mem_fraction_static, where set, is passed as it is and SGLang sizes the pool itself."""
    if settings.mem_fraction_static is not None:
        return settings.mem_fraction_static, None
    budget = budget_bytes(settings, total_bytes)
    overhead = engine_overhead_bytes(settings.max_running_requests, vocab_size)
    kv = budget - weight_bytes - adapter_bytes - overhead
    if kv < kv_per_token * settings.context_length:
        raise ConfigError(
            f"the SGLang rollout actor's budget is {budget / 2**30:.2f} GiB: the student's weights and adapter take"
            f" {(weight_bytes + adapter_bytes) / 2**30:.2f} GiB and the engine needs {overhead / 2**30:.2f} GiB beside"
            f" them (its graphs, and the sampler's buffers for {settings.max_running_requests} rows decoded at once"
            f" over {vocab_size:,} tokens), leaving {max(kv, 0) / 2**30:.2f} GiB for the KV pool, less than one row"
            f" of {settings.context_length} tokens; raise resources.rollout.num_gpus, lower"
            " rollout.sglang.max_running_requests (the rows beyond it wait for a free slot), or set"
            " rollout.sglang.mem_fraction_static"
        )
    return PROFILE_FRACTION, kv // kv_per_token


def budget_bytes(settings: SglangSettings, total_bytes: int) -> int:
    """The rollout actor's memory: its emulated cap, else its share of the device less its CUDA context (as the fit
    planner shares the card: setup/fit.py)."""
    from miniverl.process import CUDA_CONTEXT_GIB

    if settings.gpu_cap_gib is not None:
        return int(settings.gpu_cap_gib * 2**30)
    return int(settings.gpu_share * total_bytes - CUDA_CONTEXT_GIB * 2**30)


def request_params(params: SamplingParams, seed: int) -> dict:
    """One row's SGLang sampling params: the run's sampling settings and the row's seed."""
    return {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k or -1,  # SGLang: -1 = the whole vocabulary; ours: 0 = off
        "top_p": params.top_p,
        "stop_token_ids": list(params.stop_token_ids),
        "sampling_seed": seed,
    }


def completion(output: dict) -> Completion:
    """One SGLang output (skip_tokenizer_init) as a row: its ids, their original log-probs, whether it stopped."""
    ids = list(output["output_ids"])
    meta = output["meta_info"]
    logprobs = [lp for lp, _token, *_ in meta["output_token_logprobs"]]
    if len(logprobs) != len(ids):
        raise RuntimeError(
            f"SGLang returned {len(ids)} token ids but {len(logprobs)} log-probs for one row; this backend was written"
            " against sglang 0.5.17, whose outputs carry one log-prob per output id"
        )
    return Completion(ids, logprobs, (meta.get("finish_reason") or {}).get("type") == "stop")


def use_compat_shim() -> None:
    """sglang_compat/sitecustomize.py in this process and, through PYTHONPATH, in every process the engine starts."""
    import miniverl.rollout.sglang_compat.sitecustomize as shim

    folder = str(Path(shim.__file__).parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])


class SglangBackend:
    """Serves the published policy through an SGLang engine; each policy version a new adapter."""

    def __init__(
        self, model_path: str, lora: LoraSettings, dtype: torch.dtype, device: str, settings: SglangSettings
    ) -> None:
        if device != "cuda" or not torch.cuda.is_available():
            raise ConfigError("rollout=sglang needs a CUDA GPU; use rollout=hf_cached on the CPU")
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # read when SGLang's sampler is imported
        os.environ[BATCH_INVARIANT_ENV] = "1" if settings.batch_invariant else "0"  # read by the shim in each process
        os.environ["SGLANG_LOGPROB_CHUNK_SIZE"] = str(LOGPROB_CHUNK_TOKENS)  # read by SGLang's log-prob processor
        use_compat_shim()
        import sglang

        self.settings, self.lora, self.model_path = settings, lora, model_path
        self.probe_tolerance = probe_tolerance(dtype)  # bf16 engine vs bf16 learner: unmeasured for SGLang
        self.version = 0
        self.adapter: str | None = None  # the adapter name now served
        self._weights = adapter_template(model_path, lora, dtype)  # zeros under the learner's names, until a load
        total = torch.cuda.get_device_properties(0).total_memory
        config = load_model_config(model_path, "model.student.path", "check the student's config.json")
        weights = model_size(model_path, config).weight_bytes("none", dtype.itemsize)
        adapter = sum(t.numel() for t in self._weights.values()) * dtype.itemsize
        kv_per_token = kv_bytes_per_token(config, dtype.itemsize)
        fraction, kv_tokens = memory_plan(settings, total, config.vocab_size, weights, adapter, kv_per_token)
        self.kv_tokens = kv_tokens  # the KV pool the plan sized, in tokens (None: SGLang's own sizing)
        if settings.gpu_cap_gib is not None:  # the scheduler's allocator capped as every actor's is (the shim)
            os.environ[MEMORY_CAP_ENV] = str(budget_bytes(settings, total))
        else:
            os.environ.pop(MEMORY_CAP_ENV, None)
        self.started_s = time.perf_counter()
        try:
            self.engine = sglang.Engine(
                model_path=model_path,
                skip_tokenizer_init=True,
                dtype=str(dtype).removeprefix("torch."),
                random_seed=0,
                mem_fraction_static=fraction,
                max_total_tokens=kv_tokens,
                context_length=settings.context_length,
                max_running_requests=settings.max_running_requests,
                # SGLang sizes these from the whole card (8,192 and 256 on an 80 GB one, sglang-gpu/run2.md), not from
                # the share
                chunked_prefill_size=settings.chunked_prefill_size,
                cuda_graph_max_bs_decode=settings.max_running_requests,  # the step's rows decode inside graphs
                attention_backend=settings.attention_backend,
                enable_deterministic_inference=True,  # else sampling_seed is ignored; sampling runs on pytorch
                enable_lora=True,
                max_lora_rank=lora.rank,
                lora_target_modules=list(lora.target_modules),
                max_loras_per_batch=1,
                log_level="error",
            )
        except Exception as e:  # the engine's own reason, plus the settings that size it
            raise ConfigError(
                f"the SGLang engine did not start: {type(e).__name__}: {e}. It was asked for mem_fraction_static="
                f"{fraction:.3f} of the free memory and a KV pool of {kv_tokens or 'its own size of'} tokens on a"
                f" {total / 2**30:.1f} GiB device; raise resources.rollout.num_gpus, set"
                " rollout.sglang.mem_fraction_static or a smaller rollout.sglang.max_running_requests, or try"
                " rollout.sglang.attention_backend=flashinfer"
            ) from e
        self.started_s = time.perf_counter() - self.started_s

    # -- refresh ---------------------------------------------------------------------------------------
    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        """Serve `weights` (peft names) as a new adapter, drop the previous one and the radix cache built under it."""
        weights = {k: v.to("cpu", copy=True) if v.is_cuda else v for k, v in weights.items()}
        self.version += 1
        name = f"miniverl-v{self.version}"
        config = {
            "r": self.lora.rank,
            "lora_alpha": self.lora.alpha,
            "target_modules": list(self.lora.target_modules),
            "bias": "none",
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
        }
        self.engine.load_lora_adapter_from_tensors(name, weights, config)
        old, self.adapter = self.adapter, name
        if old is not None:
            self.engine.unload_lora_adapter(old)
        flushed = self.engine.flush_cache()
        if getattr(flushed, "success", flushed) is False:
            raise RuntimeError(
                "SGLang refused to flush its radix cache after loading policy version"
                f" {self.version} (requests still in flight?); a stale prefix could be served, so the run stops"
            )
        self._weights = weights

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The weights last handed to the engine (its own LoRA buffers cannot be read back as the learner's bytes)."""
        return self._weights

    def served_digest(self) -> None:
        """None: SGLang serves from its own LoRA buffers, so every refresh is proven by the probe."""
        return None

    # -- serving ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        n = params.n
        if len(seeds) != len(prompts) * n:
            raise ValueError(f"need one seed per completion ({len(prompts) * n}), got {len(seeds)}")
        rows = [list(p) for p in prompts for _ in range(n)]  # prompt-major, sample-minor: the rows' order
        outputs = self.engine.generate(
            input_ids=rows,
            sampling_params=[request_params(params, s) for s in seeds],
            return_logprob=True,
            lora_path=[self.adapter] * len(rows),
        )
        return [completion(o) for o in outputs]

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t >= 1 through the engine (the prompt's log-probs), temperature 1."""
        outputs = self.engine.generate(
            input_ids=[list(s) for s in sequences],
            sampling_params={"max_new_tokens": 1, "temperature": 1.0},
            return_logprob=True,
            logprob_start_len=0,
            lora_path=[self.adapter] * len(sequences),
        )
        return [[lp for lp, _token, *_ in o["meta_info"]["input_token_logprobs"][1:]] for o in outputs]

    def close(self) -> None:
        self.engine.shutdown()
        torch.cuda.empty_cache()
