"""Run a bench: one backend at a time (so memory is attributed to it), warm-up then timed repeats per cell,
then the oracle judges every cell that produced samples, then the report.

Timing: wall clock around `generate`, which returns Python lists (so the device has finished); tokens/s
counts the tokens the backend returned. Memory (CUDA): peaks of this process's allocator per cell, and
the device's used memory at the end of the cell before the allocator cache is released; the caching
allocator keeps every block it reserved, so that reading includes the cell's peak plus the CUDA context.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from lab.bench import invalidation, oracle
from lab.bench.baselines import BASELINES
from lab.bench.config import BackendPlan, BenchConfig
from lab.bench.report import write_report
from lab.bench.workload import (
    Cell,
    cell_requests,
    expand_cells,
    lora_settings,
    make_adapter,
)
from miniverl.errors import ConfigError
from miniverl.models.loading import torch_dtype
from miniverl.models.random_init import build_random_model
from miniverl.process import memory_report
from miniverl.rollout import BACKENDS, Completion


class TimeCapExceeded(Exception):
    pass


@dataclass
class CellResult:
    label: str
    backend: str
    length: int
    prompts: int
    samples: int
    status: str = "pending"  # pending -> valid | invalid | not_run
    reasons: list[str] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)  # timed repeats
    tokens_per_s: list[float] = field(default_factory=list)
    spread: float | None = None
    memory: dict[str, float] = field(default_factory=dict)
    oracle: dict[str, float] = field(default_factory=dict)
    identical_to_baseline: float | None = None
    decode_mode: str | None = None
    load_s: float | None = None
    completions: list[Completion] | None = field(default=None, repr=False)  # kept for the judge, not reported

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    def stop(self, status: str, reason: str) -> None:
        self.status = status
        self.reasons.append(reason)


@dataclass
class Context:
    cfg: BenchConfig
    device: str
    dtype: torch.dtype
    model_dir: Path
    adapter: dict[str, torch.Tensor] | None = None

    def build(self, name: str, options: dict | None = None):
        """A product backend or a bench baseline, serving the bench's adapter. `options` go to the constructor."""
        cls = BASELINES[name] if name in BASELINES else BACKENDS.get(name)
        backend = cls(
            model_path=str(self.model_dir),
            lora=lora_settings(self.cfg.adapter),
            dtype=self.dtype,
            device=self.device,
            **(options or {}),
        )
        if self.adapter is None:
            self.adapter = make_adapter(backend.adapter_weights(), self.cfg.adapter)
        backend.load_adapter(self.adapter)
        return backend


def run_bench(cfg: BenchConfig, command: str, log=print) -> tuple[Path, Path]:
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.torch_threads or os.cpu_count() or 1)
    dtype = torch_dtype(cfg.dtype, device)
    results = [
        CellResult(c.label, cfg.backends[c.label].backend, c.length, c.prompts, c.samples) for c in expand_cells(cfg)
    ]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miniverl-bench-") as tmp:
        t0 = time.perf_counter()
        ctx = Context(cfg, device, dtype, build_random_model(cfg.model, dtype, device, Path(tmp) / "model"))
        build_s = time.perf_counter() - t0
        log(f"[bench] {cfg.name}: built the random-init model in {build_s:.1f}s on {device} ({cfg.dtype})")

        def checkpoint() -> None:  # a partial report after every cell, in case the run is killed
            write_report(cfg, command, results, build_s, time.perf_counter() - started)

        for label, plan in cfg.backends.items():
            run_backend(ctx, plan, [r for r in results if r.label == label], log, checkpoint)
        judge(ctx, results, log)
    return write_report(cfg, command, results, build_s, time.perf_counter() - started)


def resolve_device(name: str) -> str:
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"bench.device={name!r}: use auto, cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("bench.device=cuda but no GPU is visible")
    return "cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu"


def run_backend(ctx: Context, plan: BackendPlan, results: list[CellResult], log, checkpoint=lambda: None) -> None:
    if plan.backend not in BACKENDS and plan.backend not in BASELINES:
        for r in results:
            r.stop(
                "not_run", f"backend {plan.backend!r} does not exist yet (registered: {', '.join(BACKENDS.names())})"
            )
        log(f"[bench] {plan.backend}: not run ({results[0].reasons[0]})")
        return
    if plan.backend in ("vllm", "raw_vllm", "sglang"):
        from miniverl.rollout import require_engine

        try:
            require_engine("sglang" if plan.backend == "sglang" else "vllm", ctx.device)
        except ConfigError as e:
            for r in results:
                r.stop("not_run", str(e))
            log(f"[bench] {plan.backend}: not run ({e})")
            return
    try:
        t0 = time.perf_counter()
        options, attributes = constructor_options(ctx.cfg, plan)
        backend = ctx.build(plan.backend, options)
        for key, value in attributes.items():
            if not hasattr(backend, key):
                raise ConfigError(f"backend {plan.backend!r} has no attribute {key!r} to set")
            setattr(backend, key, value)
        load_s = time.perf_counter() - t0
    except ImportError as e:
        for r in results:
            r.stop("not_run", f"backend {plan.backend!r} cannot be imported here: {e}")
        return
    except Exception as e:
        reason = invalidation.OUT_OF_MEMORY if _is_oom(e) else f"error while loading: {type(e).__name__}: {e}"
        for r in results:
            r.stop("invalid", reason)
        return
    for r in results:
        r.load_s = load_s
        run_cell(ctx, plan, backend, r)
        log(f"[bench] {_describe(r)}", flush=True)
        checkpoint()
    if hasattr(backend, "close"):  # an engine (vLLM) frees its memory and process state before the next one
        backend.close()
    del backend
    _release(ctx.device)


def constructor_options(cfg: BenchConfig, plan: BackendPlan) -> tuple[dict, dict]:
    """Split a plan's attributes into constructor options and attributes set afterwards.

    vllm, raw_vllm and sglang are sized at construction: their attributes are constructor arguments, and the bench's
    cells fix the engine's row count and context length. Other backends get attributes set on the instance.
    """
    rows = max(g * n for g, n in cfg.shapes)
    context = cfg.workload.prompt_max_len + max(cfg.lengths)
    if plan.backend == "raw_vllm":
        return {"max_num_seqs": rows, "max_model_len": context, **plan.attributes}, {}
    if plan.backend == "vllm":
        from lab.bench.engine_settings import check_vllm_settings
        from miniverl.config import VllmRolloutConfig
        from miniverl.rollout.vllm_settings import VllmSettings

        # A bench preregistered before the backend existed (rollout-runtime-v3) names no attributes: it gets
        # the product's defaults and half the GPU.
        # The engine's fixed choices (seeding, engine_process, enforce_eager, ...) are VllmSettings' defaults; a plan's
        # attributes may set them on the settings built here.
        product = VllmRolloutConfig()
        a = {
            "refresh": product.refresh,
            "gpu_share": 0.5,
            "quantization": "none",  # the bench's model is bf16
        } | dict(plan.attributes)
        capture = a.pop("cudagraph_capture_size", rows)
        settings = VllmSettings(
            max_num_seqs=rows,
            cudagraph_capture_size=capture,
            max_num_batched_tokens=product.max_num_batched_tokens,
            max_model_len=context,
            gpu_cap_gib=None,
            kv_cache_gib=product.kv_cache_gib,
            **a,
        )
        check_vllm_settings(settings)  # a plan's attributes are rollout.vllm values that no validate has seen
        return {"settings": settings}, {}
    if plan.backend == "sglang":  # sized at construction too; its attributes are rollout.sglang keys (or gpu_share)
        from lab.bench.engine_settings import sglang_settings

        return {"settings": sglang_settings(rows, context, plan.attributes)}, {}
    return {}, dict(plan.attributes)


def run_cell(ctx: Context, plan: BackendPlan, backend, r: CellResult) -> None:
    prompts, params, seeds = cell_requests(ctx.cfg, Cell(r.label, r.length, r.prompts, r.samples))
    _release(ctx.device)
    try:
        warm = replace(params, max_new_tokens=plan.warmup_max_new_tokens or r.length)
        for _ in range(plan.warmup_runs):
            _timed(backend, prompts, warm, seeds, plan.time_cap_s, ctx.device)
        for _ in range(plan.repeats):
            wall, out = _timed(backend, prompts, params, seeds, plan.time_cap_s, ctx.device)
            r.wall_s.append(wall)
            r.tokens_per_s.append(sum(len(c.token_ids) for c in out) / wall)
            r.completions = out
    except TimeCapExceeded as e:
        r.stop("invalid", f"{invalidation.TIME_CAP}: {e}")
    except Exception as e:
        if not _is_oom(e):
            r.stop("invalid", f"error: {type(e).__name__}: {e}")
        else:
            r.stop("invalid", invalidation.OUT_OF_MEMORY)
    if r.status == "invalid":
        r.completions = None  # partial repeats prove nothing
    r.decode_mode = getattr(backend, "decode_mode", None)
    r.memory = _memory(ctx.device)


def _timed(backend, prompts, params, seeds, cap_s: float, device: str) -> tuple[float, list[Completion]]:
    _sync(device)
    t0 = time.perf_counter()
    with _time_cap(backend, t0 + cap_s, cap_s):
        out = backend.generate(prompts, params, seeds)
    _sync(device)
    wall = time.perf_counter() - t0
    if wall > cap_s:
        raise TimeCapExceeded(f"a run took {wall:.1f}s > {cap_s:g}s")
    return wall, out


@contextmanager
def _time_cap(backend, deadline: float, cap_s: float):
    """Stop a backend whose steps go through `backend.model` (hf_reference) at its first forward past the
    deadline; others are judged after the run."""
    model = getattr(backend, "model", None)
    handle = None
    if isinstance(model, torch.nn.Module):

        def check(*_args) -> None:
            if time.perf_counter() > deadline:
                raise TimeCapExceeded(f"stopped after {cap_s:g}s")

        handle = model.register_forward_pre_hook(check)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def judge(ctx: Context, results: list[CellResult], log) -> None:
    """Apply the preregistered rules to every cell that finished its runs."""
    for r in results:
        if r.completions is not None and not any(c.logprobs for c in r.completions):
            r.stop("unjudged", "the backend returns no log-probs, so the oracle cannot judge it (speed only)")
            r.completions = None
    measured = [r for r in results if r.completions is not None]
    if not measured:
        return
    rules = ctx.cfg.invalidation
    baseline = {(r.length, r.prompts, r.samples): r for r in results if r.label == ctx.cfg.baseline}
    try:
        judge_model = ctx.build(ctx.cfg.oracle)
    except Exception as e:
        for r in measured:
            r.stop("invalid", f"oracle {ctx.cfg.oracle!r} unavailable: {type(e).__name__}: {e}")
        return
    for r in measured:
        prompts, params, _ = cell_requests(ctx.cfg, Cell(r.label, r.length, r.prompts, r.samples))
        reasons = invalidation.short_rows([len(c.token_ids) for c in r.completions], r.length)
        r.spread, spread_reasons = invalidation.spread(r.tokens_per_s, rules.spread_max)
        reasons += spread_reasons
        try:
            gaps = oracle.logprob_gaps(judge_model, prompts, params.n, r.completions)
            r.oracle, gap_reasons = invalidation.logprob_gap(gaps, rules)
            reasons += gap_reasons
        except Exception as e:
            reasons.append(invalidation.OUT_OF_MEMORY if _is_oom(e) else f"oracle check failed: {e}")
        base = baseline.get((r.length, r.prompts, r.samples))
        if base is not None and base.completions is not None:
            r.identical_to_baseline = oracle.identical_fraction(r.completions, base.completions)
        r.status = "invalid" if reasons else "valid"
        r.reasons += reasons
        log(f"[bench] judged {_describe(r)}")
    del judge_model
    _release(ctx.device)


def _describe(r: CellResult) -> str:
    tps = f"{max(r.tokens_per_s):.0f} tok/s best" if r.tokens_per_s else "no timing"
    why = f" {'; '.join(r.reasons)}" if r.reasons else ""
    return f"{r.label} T={r.length} {r.prompts}x{r.samples}: {r.status} ({tps}){why}"


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _memory(device: str) -> dict[str, float]:
    if device != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {**memory_report(device), "device_used_gib": (total - free) / 2**30}  # the actors' peaks, alloc_retries
