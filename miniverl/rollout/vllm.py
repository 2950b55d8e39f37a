"""The vLLM rollout backend: vLLM's Python engine inside the rollout actor, raw token ids in and out.

Facts it relies on (vLLM 0.26.0, DESIGN.md "vLLM facts"):
- `skip_tokenizer_init=True`: no tokenizer, so stopping is `stop_token_ids` only and prompts are
  `TokensPrompt`s;
- `SamplingParams(logprobs=0)` returns the sampled token's log-prob; `logprobs_mode="raw_logprobs"` makes
  it the untempered, untruncated policy's, which is what RolloutBatch.rollout_log_probs means (and what
  the HF backends return); `prompt_logprobs=0` scores given tokens (the strict-sync probe);
- an adapter is cached by its int id, and the prefix cache keys on the adapter name: every policy version
  gets a new name and id, the previous one is removed, and the prefix cache is reset;
- with `enable_lora=False` the model's `load_weights` takes Hugging Face names and fuses q/k/v and
  gate/up itself, which is how merged mode refreshes the weights in place.
Importing this module imports no vLLM; constructing the backend does.
"""

from __future__ import annotations

import os
import time

import torch

from miniverl.errors import ConfigError
from miniverl.models.lora import LoraSettings, adapter_template
from miniverl.rollout import Completion
from miniverl.rollout.sampling import SamplingParams
from miniverl.rollout.vllm_settings import (
    SEEDING,
    AdapterStore,
    VllmSettings,
    adapter_config,
    base_linear_weights,
    memory_plan,
    merged_weights,
    served_weight_bytes,
    vllm_lora_rank,
)
from miniverl.served_policy import probe_tolerance

# How generate may seed its requests: VllmSettings' seedings (a run's: row), and "none" for bench peers.
REQUEST_SEEDINGS = (*SEEDING, "none")


def sampling_requests(
    prompts: list[list[int]], params: SamplingParams, seeds: list[int], seeding: str, logprobs: bool = True
) -> tuple[list, list]:
    """One generate call's vLLM requests and their sampling params; the outputs come back prompt-major,
    sample-minor, the rows' order.

    seeding: "row": one request per row, seeded by its row seed (the product's default); "prompt": one request per
    prompt with n samples, seeded by its first row's seed (vLLM seeds sample j with that seed + j); "none": one
    request per prompt, unseeded (vLLM's batched sampler, not reproducible: for bench peers). Requests that share a
    seed share their sampling noise: one seed handed to every prompt makes the step n streams, not G x n draws (the
    bench's vLLM peer did that until 2026-12-04, lab/results/decode-profile.md: its rows' stop hazard read 0.71x the
    law's).
    """
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    n = params.n
    if len(seeds) != len(prompts) * n:
        raise ValueError(f"need one seed per completion ({len(prompts) * n}), got {len(seeds)}")
    if seeding not in REQUEST_SEEDINGS:
        raise ValueError(f"seeding {seeding!r}: use {', '.join(REQUEST_SEEDINGS[:-1])} or {REQUEST_SEEDINGS[-1]}")

    def sp(count: int, seed: int | None):
        return VllmSamplingParams(
            n=count,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            stop_token_ids=list(params.stop_token_ids),
            seed=seed,
            logprobs=0 if logprobs else None,
            detokenize=False,
        )

    if seeding == "row":  # the row's seed alone decides its tokens
        return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(n)], [sp(1, s) for s in seeds]
    firsts = [seeds[i * n] if seeding == "prompt" else None for i in range(len(prompts))]
    return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], [sp(n, s) for s in firsts]


def completions(outputs, logprobs: bool = True) -> list[Completion]:
    """vLLM's request outputs as rows (prompt-major, sample-minor), with the sampled tokens' log-probs if asked."""
    done = []
    for out in outputs:
        for c in out.outputs:
            ids = list(c.token_ids)
            lps = [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)] if logprobs else []
            done.append(Completion(ids, lps, c.finish_reason == "stop"))
    return done


class VllmBackend:
    """Serves the published policy through a vLLM engine; `settings.refresh` picks how a version arrives."""

    def __init__(
        self, model_path: str, lora: LoraSettings, dtype: torch.dtype, device: str, settings: VllmSettings
    ) -> None:
        if device != "cuda" or not torch.cuda.is_available():
            raise ConfigError("rollout=vllm needs a CUDA GPU; use rollout=hf_cached on the CPU")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if settings.engine_process == "inprocess" else "1"
        from vllm import LLM

        self.settings, self.lora, self.model_path = settings, lora, model_path
        self.scale = lora.alpha / lora.rank  # peft's plain-LoRA scaling, which vLLM applies too
        # miniverl/served_policy.py's bound for the dtype. Measured for this engine: bf16 vLLM against bf16
        # HF of the same weights and adapter, at most 0.098 nats over ~1M sampled tokens
        # (lab/results/rollout-rl-sizes.md).
        self.probe_tolerance = probe_tolerance(dtype)
        self.version = 0
        self.request = None  # the LoRARequest now served (adapter mode)
        self.asleep = False
        self._weights = adapter_template(model_path, lora, dtype)
        total = torch.cuda.get_device_properties(0).total_memory
        weights = served_weight_bytes(model_path, dtype, settings.quantization)
        adapter = sum(t.numel() for t in self._weights.values()) * dtype.itemsize
        utilization, kv_bytes = memory_plan(settings, total, weights, adapter)
        kwargs = {
            "model": model_path,
            "skip_tokenizer_init": True,
            "dtype": str(dtype).removeprefix("torch."),
            "seed": 0,
            "enforce_eager": settings.enforce_eager,
            "max_model_len": settings.max_model_len,
            "max_num_seqs": settings.max_num_seqs,
            "enable_prefix_caching": settings.enable_prefix_caching,
            "async_scheduling": settings.async_scheduling,
            "gpu_memory_utilization": utilization,
            "kv_cache_memory_bytes": kv_bytes,
            "logprobs_mode": "raw_logprobs",
            "enable_sleep_mode": settings.sleep_between_steps,
        }
        if settings.quantization == "nf4":
            # vLLM quantizes the bf16 checkpoint to bitsandbytes NF4 while loading, the base the NF4 learner
            # trains on: measured against that learner, mean gap 0.10 nats (bf16 engine: 1.66; DESIGN.md).
            # The memory plan above sizes its linear layers in NF4 (vllm_settings.served_weight_bytes).
            kwargs["quantization"] = "bitsandbytes"
        if settings.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
        if not settings.enforce_eager:
            kwargs["compilation_config"] = {"max_cudagraph_capture_size": settings.cudagraph_capture_size}
        if settings.refresh == "adapter":
            kwargs |= {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora.rank), "max_loras": 1}
        self.started_s = time.perf_counter()
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:  # the engine's own reason, plus the settings that size it
            raise ConfigError(
                f"the vLLM engine did not start: {type(e).__name__}: {e}. It was asked for"
                f" gpu_memory_utilization={utilization:.3f} of {total / 2**30:.1f} GiB and a KV cache of"
                f" {'(profiled)' if kv_bytes is None else f'{kv_bytes / 2**30:.2f} GiB'}; raise"
                " resources.rollout.num_gpus, set rollout.vllm.kv_cache_gib, lower rollout.max_new_tokens /"
                " data.max_prompt_length, or free GPU memory (the rollout actor starts first)"
            ) from e
        self.started_s = time.perf_counter() - self.started_s
        self.store = None
        self.base = None
        if settings.refresh == "adapter":
            self.store = AdapterStore(
                os.path.join(settings.adapter_root, f"miniverl-{os.getpid()}"),
                adapter_config(lora.rank, lora.alpha, lora.target_modules, model_path),
            )
        else:
            self.base = base_linear_weights(model_path, list(self._weights), dtype)

    # -- refresh ---------------------------------------------------------------------------------------
    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        """Serve `weights` (peft names; CPU tensors, or GPU ones mapped from the learner's buffer, which are
        copied to the host here: the adapter store writes files and the learner rewrites its buffer later)."""
        from vllm.lora.request import LoRARequest

        weights = {k: v.to("cpu", copy=True) if v.is_cuda else v for k, v in weights.items()}
        self._wake()
        self.version += 1
        if self.store is not None:
            path = self.store.write(self.version, weights)
            old, self.request = self.request, LoRARequest(f"miniverl-v{self.version}", self.version, str(path))
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
            self.llm.llm_engine.add_lora(self.request)  # load now, so the refresh (not generate) pays for it
        else:
            merged = merged_weights(self.base, weights, self.scale, "cuda")
            self.llm.apply_model(lambda model: model.load_weights(merged.items()))
            del merged
        self.llm.reset_prefix_cache()
        self._weights = weights

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The weights last handed to the engine (the engine's fused, padded copies cannot be read back as
        the learner's bytes: the strict-sync probe, not this, proves what it serves)."""
        return self._weights

    def served_digest(self) -> None:
        """None: the engine serves from fused, padded copies (or, merged, from the base weights) that cannot be
        read back as the learner's bytes, so every refresh is proven by the probe (miniverl/step/sync.py)."""
        return None

    def served_adapters(self) -> list[int]:
        """Adapter ids the engine holds (adapter mode; one after every refresh)."""
        return sorted(self.llm.llm_engine.list_loras()) if self.store is not None else []

    # -- serving ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        requests, sampling = sampling_requests(prompts, params, seeds, self.settings.seeding)
        self._wake()
        done = completions(self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.request))
        if self.settings.sleep_between_steps:
            self.sleep()
        return done

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t >= 1 through the engine (prompt log-probs), temperature 1."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        self._wake()
        sp = VllmSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(s)) for s in sequences], sp, use_tqdm=False, lora_request=self.request
        )
        return [[o.prompt_logprobs[t][s[t]].logprob for t in range(1, len(s))] for o, s in zip(outs, sequences)]

    # -- memory ----------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache dropped; nothing is lost (level 2 would drop weights)."""
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        shutdown_engine(self.llm)
        del self.llm


def shutdown_engine(llm) -> None:
    """Stop an engine and, for an in-process one, the torch.distributed state it set up in this process."""
    engine = getattr(llm.llm_engine, "engine_core", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    torch.cuda.empty_cache()
