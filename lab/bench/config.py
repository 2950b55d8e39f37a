"""The bench schema. Fields have no defaults on purpose: a preregistered bench file states every value,
so changing code can never silently change what a published benchmark measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from miniverl.models.random_init import ModelShape


@dataclass
class AdapterSpec:
    """The LoRA adapter served by every backend: every tensor drawn from N(0, init_std^2) with `seed`."""

    rank: int = MISSING
    alpha: float = MISSING
    target_modules: list[str] = MISSING
    init_std: float = MISSING
    seed: int = MISSING


@dataclass
class WorkloadSpec:
    """Random-token prompts of lengths in [prompt_min_len, prompt_max_len]; no stop tokens, so every row
    generates exactly the cell's length."""

    prompt_min_len: int = MISSING
    prompt_max_len: int = MISSING
    temperature: float = MISSING
    top_k: int = MISSING
    top_p: float = MISSING
    seed: int = MISSING


@dataclass
class BackendPlan:
    backend: str = MISSING  # a name in miniverl.rollout.BACKENDS
    repeats: int = MISSING  # timed runs per cell
    warmup_runs: int = MISSING  # untimed runs per cell, before the timed ones
    warmup_max_new_tokens: int | None = MISSING  # null = the cell's length
    time_cap_s: float = MISSING  # a run longer than this invalidates the cell ("time cap")
    attributes: dict[str, Any] = field(default_factory=dict)  # instance knobs a variant sets (not product config)


@dataclass
class InvalidationRules:
    """Sampled-token log-prob gap |backend - oracle (teacher-forced)|, and timing spread."""

    logprob_gap_mean_max: float = MISSING  # nats/token, over every generated token of the cell
    logprob_gap_outlier: float = MISSING  # a token whose gap exceeds this is an outlier
    logprob_gap_outlier_frac_max: float = MISSING
    spread_max: float = MISSING  # (max - min) / median of tokens/s over the timed repeats


@dataclass
class BenchConfig:
    name: str = MISSING
    description: str = MISSING
    device: str = MISSING  # auto | cpu | cuda
    dtype: str = MISSING  # bfloat16 | float32 | float16
    torch_threads: int = MISSING  # CPU threads for torch; 0 = all cores
    model: ModelShape = field(default_factory=ModelShape)
    adapter: AdapterSpec = field(default_factory=AdapterSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    lengths: list[int] = MISSING  # generated tokens per row
    shapes: list[list[int]] = MISSING  # [prompts, samples per prompt]
    backends: dict[str, BackendPlan] = MISSING  # label -> plan, run in this order
    baseline: str = MISSING  # label whose tokens/s every speedup divides by
    oracle: str = MISSING  # backend name whose teacher-forced log-probs judge every cell's samples
    targets: dict[str, float] = MISSING  # label -> minimum speedup over the baseline in every cell
    invalidation: InvalidationRules = field(default_factory=InvalidationRules)
    output_dir: str = MISSING


@dataclass
class BenchMain:
    bench: BenchConfig = MISSING


MAIN_NAME = "bench_main"


def register_configs() -> None:
    """Put the schema in Hydra's ConfigStore (called by the bench entry point, not at import)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=MAIN_NAME, node=BenchMain)
