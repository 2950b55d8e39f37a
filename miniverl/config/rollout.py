"""The rollout section: the backend that samples, its sampling settings and vLLM's options."""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config.base import require


@dataclass
class VllmRolloutConfig:
    """rollout=vllm only (miniverl/rollout/vllm.py); docs/benchmarks/rollout-rl-sizes.md measured the choices."""

    refresh: str = "adapter"  # adapter: a new LoRA request per version | merged: adapter merged into the base in place
    enforce_eager: bool = False  # True turns CUDA graphs off (engine start ~30 s instead of ~90 s)
    engine_process: str = "inprocess"  # inprocess: engine core in the actor | subprocess: vLLM's own child process
    seeding: str = "row"  # row: one seed per sampled row (the project's rule) | prompt: one seed per prompt, n samples
    max_num_seqs: int = 0  # rows decoded at once; 0 = the largest rollout batch of the run
    cudagraph_capture_size: int = 0  # largest decode batch with a CUDA graph; 0 = max_num_seqs
    # prompt tokens one engine step prefills (chunked prefill); 0 = vLLM's default (16,384). Its activations are not
    # in the engine's fixed overhead: a 1.5B student's MLP alone takes ~0.3 GiB per 16k-token chunk
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    sleep_between_steps: bool = False  # sleep(level=1) after generating: weights to host memory, KV cache freed
    kv_cache_gib: float | None = None  # explicit KV cache size; null = derived from the actor's GPU share
    adapter_root: str = "/dev/shm"  # adapter versions are written here (shared memory), one at a time

    def check(self) -> None:
        """The engine's sizes are counts (0 = derived); the choices and the sizes' combinations are checked by
        rollout/vllm_settings.py once the engine's sizes, which other sections imply, are derived."""
        for key in ("max_num_seqs", "cudagraph_capture_size", "max_num_batched_tokens"):
            value = getattr(self, key)
            require(value >= 0, f"rollout.vllm.{key}={value}: use 0 (derived) or a positive count")


@dataclass
class RolloutConfig:
    backend: str = "hf_reference"  # a name in miniverl.rollout.BACKENDS
    n: int = 2  # N: samples per prompt
    temperature: float = 1.0  # sampling temperature (0 = greedy); the loss temperature is separate
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 16
    seed: int = 0
    # Extra stop ids on top of the tokenizer's EOS and every EOS id in the model's generation_config.
    stop_token_ids: list[int] = field(default_factory=list)
    vllm: VllmRolloutConfig = field(default_factory=VllmRolloutConfig)

    def check(self) -> None:
        """The sampling settings, and rollout.vllm's own sizes (its choices and combinations are checked by
        rollout/vllm_settings.py once the engine's sizes, which other sections imply, are derived)."""
        from miniverl.rollout import BACKENDS
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
        BACKENDS.require(self.backend)
        self.vllm.check()
