"""The rollout section: the backend that samples, its sampling settings and vLLM's options."""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config.base import require
from miniverl.registry import Registry

REFRESH_MODES = ("adapter", "merged")  # rollout.vllm.refresh
AUTO_BACKEND = "auto"  # rollout.backend chosen from the student (RolloutConfig.chosen_backend)
SGLANG_ATTENTION = ("triton", "flashinfer", "fa3")  # rollout.sglang.attention_backend

# rollout.backend's names, each a lazy "module:class" path into miniverl/rollout/ (resolved, and the backend imported,
# only by BACKENDS.get in the rollout actor): the config checks a name here without importing any backend, and
# miniverl.rollout hands this registry on as its own.
BACKENDS = Registry("rollout backend", "rollout.backend")
BACKENDS.register("hf_reference", "miniverl.rollout.hf_reference:HFReferenceBackend")
BACKENDS.register("hf_cached", "miniverl.rollout.hf_cached:HFCachedBackend")
BACKENDS.register("vllm", "miniverl.rollout.vllm:VllmBackend")
# sglang 0.5.17; end to end on an H100: lab/results/sglang-gpu/run2.md
BACKENDS.register("sglang", "miniverl.rollout.sglang:SglangBackend")


@dataclass
class VllmRolloutConfig:
    """rollout=vllm only (miniverl/rollout/vllm.py); lab/results/rollout-rl-sizes.md measured the choices. The
    engine's fixed choices (row seeds, engine in process, CUDA graphs, ...) are rollout/vllm_settings.py constants."""

    refresh: str = "adapter"  # adapter: a new LoRA request per version | merged: adapter merged into the base in place
    max_num_seqs: int = 0  # rows decoded at once; 0 = the largest rollout batch of the run
    # prompt tokens one engine step prefills (chunked prefill); 0 = vLLM's default (16,384). Its activations are not
    # in the engine's fixed overhead: a 1.5B student's MLP alone takes ~0.3 GiB per 16k-token chunk
    max_num_batched_tokens: int = 0
    kv_cache_gib: float | None = None  # explicit KV cache size; null = derived from the actor's GPU share

    def check(self) -> None:
        """The section's own values, whichever backend the run uses (as every section's are): the refresh mode and the
        sizes (counts, 0 = derived). max_num_batched_tokens against the rows the
        engine decodes at once reads the data section too: check_batched_tokens, from check_combinations."""
        require(
            self.refresh in REFRESH_MODES,
            f"rollout.vllm.refresh={self.refresh!r}: use one of {', '.join(REFRESH_MODES)}",
        )
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, key)
            require(value >= 0, f"rollout.vllm.{key}={value}: use 0 (derived) or a positive count")
        require(
            self.kv_cache_gib is None or self.kv_cache_gib > 0,
            f"rollout.vllm.kv_cache_gib={self.kv_cache_gib}: use a positive size or null (derived)",
        )

    def check_batched_tokens(self, rows: int) -> None:
        """`rows`: the rows the engine decodes at once (RolloutConfig.engine_rows), which one engine step must hold a
        token of each of."""
        n = self.max_num_batched_tokens
        require(
            n == 0 or n >= rows,
            f"rollout.vllm.max_num_batched_tokens={n} is below the {rows} rows the engine decodes at once"
            f" (rollout.vllm.max_num_seqs, or the step's rows): vLLM needs a step to hold one token of each; raise it"
            f" to at least {rows}, or 0 for vLLM's default",
        )


@dataclass
class SglangRolloutConfig:
    """rollout=sglang only (miniverl/rollout/sglang.py; sglang 0.5.17; its GPU tests pass and it runs the 4080 recipe
    end to end on an H100: lab/results/sglang-gpu/run3.md). No sampler choice: row seeds need SGLang's
    deterministic inference, which samples with its pytorch sampler (about 4x below hf_cached's tokens/s)."""

    # triton: the device bundle leaves out FlashAttention-3's 1.1 GB library (lab/results/sglang-feasibility.md);
    # fa3 is SGLang's Hopper default where that library is installed; flashinfer compiles its kernels on first use
    attention_backend: str = "triton"
    # null (the default): the KV pool is sized from the rollout actor's share (its emulated cap on a capped card)
    # less the weights, adapter and the engine's overhead, as `python -m miniverl.fit` plans it; a number is passed
    # to SGLang as its mem_fraction_static (a fraction of the memory free when its scheduler starts, which the other
    # actors' weights may already have taken) and SGLang sizes the pool itself
    mem_fraction_static: float | None = None
    # tokens in one prefill chunk; SGLang's own choice for a card under 20 GB (it picks 8,192 on an 80 GB one)
    chunked_prefill_size: int = 2048
    # rows decoded at once; null = the run's largest generate call. The sampler's buffers grow with it (36 bytes per
    # row and vocabulary entry: rollout/sglang.py engine_overhead_bytes); the rows beyond it wait for a free slot
    max_running_requests: int | None = None

    def running_rows(self, largest_call: int) -> int:
        """Rows SGLang decodes at once: the run's largest generate call, or max_running_requests where smaller."""
        return min(largest_call, self.max_running_requests or largest_call)

    def check(self) -> None:
        require(
            self.chunked_prefill_size > 0,
            f"rollout.sglang.chunked_prefill_size={self.chunked_prefill_size}: a positive number of tokens (2048 is"
            " SGLang's own choice for a 16 GB card)",
        )
        require(
            self.max_running_requests is None or self.max_running_requests > 0,
            f"rollout.sglang.max_running_requests={self.max_running_requests}: a positive number of rows, or null (the"
            " run's largest generate call)",
        )
        require(
            self.attention_backend in SGLANG_ATTENTION,
            f"rollout.sglang.attention_backend={self.attention_backend!r}: use one of {', '.join(SGLANG_ATTENTION)}",
        )
        require(
            self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
            f"rollout.sglang.mem_fraction_static={self.mem_fraction_static}: a fraction of the free memory in (0, 1),"
            " or null (the KV pool sized from resources.rollout.num_gpus)",
        )


@dataclass
class RolloutConfig:
    # auto (hf_cached, or hf_reference for an NF4 student: chosen_backend) | a name in BACKENDS
    backend: str = AUTO_BACKEND
    n: int = 2  # N: samples per prompt
    temperature: float = 1.0  # sampling temperature (0 = greedy); the loss temperature is separate
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 16
    seed: int = 0
    # Extra stop ids on top of the tokenizer's EOS and every EOS id in the model's generation_config.
    stop_token_ids: list[int] = field(default_factory=list)
    vllm: VllmRolloutConfig = field(default_factory=VllmRolloutConfig)
    sglang: SglangRolloutConfig = field(default_factory=SglangRolloutConfig)

    def check(self) -> None:
        """The sampling settings, and rollout.vllm's own values (what they need of other sections is
        check_combinations')."""
        from miniverl.seeds import MAX_BASE_SEED

        require(
            0 <= self.seed < MAX_BASE_SEED,
            f"rollout.seed={self.seed}: must be in [0, {MAX_BASE_SEED}) so no two seeds of a run collide"
            " (miniverl/seeds.py)",
        )
        require(
            all(i >= 0 for i in self.stop_token_ids), f"rollout.stop_token_ids={self.stop_token_ids}: ids must be >= 0"
        )
        require(self.n >= 1, f"rollout.n={self.n}: need at least one sample per prompt")
        require(self.max_new_tokens >= 1, f"rollout.max_new_tokens={self.max_new_tokens}: must be >= 1")
        require(self.temperature > 0, f"rollout.temperature={self.temperature}: training samples need temperature > 0")
        require(self.top_k >= 0, f"rollout.top_k={self.top_k}: use 0 (off) or a token count >= 1")
        require(0 < self.top_p <= 1, f"rollout.top_p={self.top_p}: use a value in (0, 1] (1 = off)")
        require(
            self.backend == AUTO_BACKEND or self.backend in BACKENDS,
            f"unknown rollout backend {self.backend!r}; known: {AUTO_BACKEND} (the default),"
            f" {', '.join(BACKENDS.names())} (set rollout.backend=<one of them>, or the config group rollout=<one>)",
        )
        self.vllm.check()
        self.sglang.check()

    def chosen_backend(self, student_quantization: str) -> tuple[str, str]:
        """(backend, why) for rollout.backend=auto: the fast HF sampler, hf_cached, which draws the tokens the
        hf_reference oracle draws (0.29 against 0.41 s a step for the built-in models on 2 busy CPU cores; 42-65x
        at the 0.5B shape on a GPU); for an NF4 student hf_reference, the HF sampler that serves the 4-bit base
        as loaded (hf_cached decodes from bf16 copies and refuses it; rollout=vllm serves it faster on a GPU)."""
        if student_quantization == "nf4":
            return (
                "hf_reference",
                "an NF4 student: it serves the 4-bit base as loaded (rollout=vllm is faster on a GPU)",
            )
        return "hf_cached", "the fast HF sampler, the same tokens as the hf_reference oracle"

    @property
    def paged_engine(self) -> bool:
        """vLLM or SGLang: an engine of its own that takes its whole share at start and fills what its weights leave
        with a paged KV cache, whatever the rows (the plan, the share chooser and the short-prompt note treat it so)."""
        return self.backend in ("vllm", "sglang")

    def largest_call(self, data) -> int:
        """Rows of the run's largest generate call: a step's data.prompts_per_step x rollout.n or the evaluation's
        data.eval_prompts (`data`: DataConfig)."""
        return max(data.prompts_per_step * self.n, data.eval_prompts)

    def engine_rows(self, data) -> int:
        """Rows the vLLM engine decodes at once: rollout.vllm.max_num_seqs, or (0) the run's largest generate call."""
        return self.vllm.max_num_seqs or self.largest_call(data)


def check_quantized_rollout(quantization: str, backend: str, refresh: str) -> None:
    """The rollout side must serve the learner's own 4-bit base (DESIGN.md: an NF4 learner against a bf16 sampler is
    off by 1.66 nats per token, against vLLM's bitsandbytes engine by 0.10). checks.py check_combinations applies it
    to model.student and rollout; rollout/vllm_settings.py to settings built without a config."""
    if quantization != "nf4":
        return
    require(
        backend != "hf_cached",
        "model.student.quantization=nf4 with rollout=hf_cached: hf_cached decodes from plain (bf16) copies of the"
        " base weights, which would sample from another base than the 4-bit one the learner trains on;"
        " serving the dequantized NF4 values is possible but not yet measured, so it is refused for now. Use"
        " rollout=vllm (adapter mode, quantization=bitsandbytes) or rollout=hf_reference",
    )
    require(
        backend != "sglang",
        "model.student.quantization=nf4 with rollout=sglang: SGLang's 4-bit path has not been measured against the NF4"
        " learner's base, so it is refused; use rollout=vllm (adapter mode, quantization=bitsandbytes) or"
        " rollout=hf_reference",
    )
    require(
        not (backend == "vllm" and refresh == "merged"),
        "model.student.quantization=nf4 with rollout.vllm.refresh=merged: merging the adapter into 4-bit weights"
        " re-quantizes them, so the engine would serve another base than the learner's; use"
        " rollout.vllm.refresh=adapter",
    )
