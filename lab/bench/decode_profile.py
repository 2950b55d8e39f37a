"""Where a decode step's time goes: hf_cached's generate at RL sizes, timed whole and traced by torch.profiler.

    python -m lab.bench.decode_profile --out DIR [--cells 64x4x512,256x4x512] [--prompt-len 16:64]
        [--stop-median 0] [--profile-steps 64] [--backend hf_cached] [--backend-args JSON]

Needs only torch, transformers and peft (no Hydra, no Ray), so it runs on the GPU machine as it is. For each cell
(prompts x samples x max new tokens) it builds the random-init Qwen2.5-0.5B-shape model with a non-zero rank-32
LoRA (the RL-size bench's model and adapter), then reports:
- `generate`: wall seconds and generated tokens/s of whole calls (after a warm-up call that captures graphs);
- `trace`: one call of `--profile-steps` new tokens under torch.profiler: GPU kernel time by category, kernels per
  decode step, the GPU's busy fraction of the wall (the rest is the host: launches, syncs, Python), and the
  host-side time of the calls that wait for the GPU or launch graphs;
- `replay`: the decode graph of the full width replayed back to back, timed by CUDA events: the step's GPU time
  with no host in the way;
- `replay_by_column`: the same graph replayed from three cache columns of the call (an eighth, half and nearly all of
  the way through its new tokens): the attention reads every column up to the one written, so a step's GPU time
  grows through the call; their mean times the call's steps is the decode's GPU time, and the wall less that is
  the prefill, the host and the syncs.
`--stop-median M` gives every row stop tokens: a set of ~ln(2) V / M token ids, so on a random-init model (nearly
uniform next-token distribution) lengths are geometric with median ~M, capped by max new tokens (a long tail: a
share of rows runs to the cap). The measured length distribution is reported with the cell.
`--backend` is a rollout backend (`hf_cached`, `hf_reference`, `sglang`: its `--backend-args` are rollout.sglang keys
and `gpu_share`, default half the GPU) or a peer the bench measures beside them
(lab/bench/baselines.py: `raw_vllm`, `hf_generate`), built with `--backend-args` (a JSON object of keyword
arguments, e.g. raw vLLM's tuned settings `{"async_scheduling": true, "engine_process": "subprocess",
"logprobs": false}`), so the peers run the same prompts, stop tokens and lengths. `--profile-steps 0` skips the
trace (vLLM's engine subprocess runs its kernels where this process's profiler cannot see them).
`--oracle-rows K` teacher-forces each cell's first K rows through hf_reference with the same model and adapter:
the mean log-prob of the sampled tokens under the model's own law (equal, up to sampling noise, for every backend
that samples from that law) and, where the backend reports log-probs, their mean gap to the oracle's. With the
measured stop hazard (stops per generated token) it tells whether two backends' different lengths come from
different laws; with stop tokens it also gives the law's own stop mass at the judged rows' positions
(`stop_mass_mean`), the hazard those rows must show. `distinct_rows`, the share of rows no other row repeats, flags
rows that share sampling noise (below 1 on a random model).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lab.bench.config import AdapterSpec
from lab.bench.random_stops import stop_set
from lab.bench.workload import lora_settings, make_adapter
from miniverl.errors import ConfigError
from miniverl.models.random_init import ModelShape, build_random_model, real_shape
from miniverl.process import memory_report
from miniverl.rollout.sampling import SamplingParams, row_seeds

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = AdapterSpec(rank=32, alpha=64.0, target_modules=list(TARGETS), init_std=0.02, seed=1)  # every cell's
TINY = ModelShape(64, 2, 4, 2, 128, 512, True, 4096, 0)  # `--shape tiny`: the CPU smoke

# Kernel name -> category, first match wins (CUDA kernel names of cuBLAS, cuDNN, ATen and Triton).
KERNEL_CATEGORIES = (
    ("gemm", r"gemm|nvjet|cutlass|sm90_xmma|cublas|splitKreduce|matmul"),
    ("softmax", r"softmax"),
    ("scan/sort", r"scan|cumsum|sort|radix|searchsorted"),
    ("reduce", r"reduce|argmax|norm"),
    ("index/copy", r"index|gather|scatter|copy|cat|memcpy|Memcpy|fill|memset|Memset"),
    ("triton", r"^triton"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
)
# Host calls that wait for the GPU or hand it work, by torch.profiler's CPU-side names.
HOST_CALLS = (
    "cudaGraphLaunch",
    "cudaStreamSynchronize",
    "cudaMemcpyAsync",
    "cudaLaunchKernel",
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::rand",
)


TOP_KERNELS = 30


def category(name: str) -> str:
    for label, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def parse_cells(text: str) -> list[tuple[int, int, int]]:
    cells = []
    for part in text.split(","):
        g, n, t = (int(x) for x in part.lower().split("x"))
        cells.append((g, n, t))
    return cells


def make_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_generate(backend, prompts, params, seeds, device: str, repeats: int) -> tuple[dict, list]:
    """Timed whole calls, and the last call's completions; on a GPU the calls' peak memory (torch's, allocated and
    reserved), what `python -m miniverl.fit` plans the rollout's peak against."""
    walls, lengths, out = [], [], []
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = backend.generate(prompts, params, seeds)
        _sync(device)
        walls.append(time.perf_counter() - t0)
        lengths = [len(c.token_ids) for c in out]
    tokens = sum(lengths)
    wall = statistics.median(walls)
    ordered = sorted(lengths)
    return {
        "wall_s": walls,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "lengths": {
            "min": ordered[0],
            "median": ordered[len(ordered) // 2],
            "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1],
            "mean": tokens / len(ordered),
            "capped_share": sum(n == params.max_new_tokens for n in lengths) / len(lengths),
        },
        # the per-token chance a row stops: |stop set| / V on a uniform next-token law (stop_set's design)
        "stop_hazard": sum(c.finished for c in out) / max(1, tokens),
        # rows are independent draws: on a random-init model two rows repeat each other only when they share
        # sampling noise (a seed handed to several requests), so a share below 1 flags correlated rows
        "distinct_rows": len({tuple(c.token_ids) for c in out}) / max(1, len(out)),
        **memory_report("cuda" if device.startswith("cuda") else device),  # the actors' peaks and alloc_retries
    }, out


def trace(backend, prompts, params, seeds, device: str) -> dict:
    """One generate call under torch.profiler: kernel time by category, kernels per step, host calls."""
    from miniverl.observe.profile import profiling

    _sync(device)
    with profiling(device.startswith("cuda")) as prof:
        t0 = time.perf_counter()
        out = backend.generate(prompts, params, seeds)
        _sync(device)
        wall = time.perf_counter() - t0
    steps = max(len(c.token_ids) for c in out)
    kernels: dict[str, dict] = {}
    by_name: dict[str, list[float]] = {}
    intervals = []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.device_time <= 0:
            continue
        k = kernels.setdefault(category(e.name), {"count": 0, "us": 0.0})
        k["count"] += 1
        k["us"] += e.device_time
        entry = by_name.setdefault(e.name[:120], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
        intervals.append((e.time_range.start, e.time_range.end))
    busy = 0.0
    last_end = -math.inf
    for start, end in sorted(intervals):  # union of kernel intervals (us)
        if end <= last_end:
            continue
        busy += end - max(start, last_end)
        last_end = end
    host = {}
    for e in prof.key_averages():
        if e.key in HOST_CALLS:
            host[e.key] = {"count": e.count, "cpu_ms": e.cpu_time_total / 1e3}
    total_kernels = sum(k["count"] for k in kernels.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return {
        "steps": steps,
        "wall_s": wall,
        "wall_ms_per_step": wall * 1e3 / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "gpu_busy_fraction": busy / 1e6 / wall,
        "kernels_per_step": total_kernels / steps,
        "kernel_ms_per_step": {c: k["us"] / 1e3 / steps for c, k in sorted(kernels.items())},
        "kernel_count_per_step": {c: k["count"] / steps for c, k in sorted(kernels.items())},
        "host_calls": host,
        "top_kernels": [{"name": n, "per_step": c / steps, "us_per_step": us / steps} for n, (c, us) in top],
    }


def replay(backend, device: str, iters: int = 100) -> dict:
    """The captured decode graphs replayed back to back (CUDA events): each width's GPU time per step."""
    if not device.startswith("cuda"):
        return {}
    return {
        str(width): _replay_ms(graph, iters)
        for width, (graph, _logits) in sorted(getattr(backend, "_graphs", {}).items())
    }


def _replay_ms(graph, iters: int) -> float:
    """GPU ms per replay of `graph`: one untimed replay, then `iters` back to back between CUDA events."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def replay_by_column(backend, device: str, prompt_width: int, new_tokens: int, iters: int = 50) -> dict:
    """The widest captured graph replayed from three points of a call (CUDA events): GPU ms per step by the cache
    column the first replay writes. Each replay writes the next column, so the points stay `iters` short of the
    cache's end. Shapes: -> {column: ms}."""
    graphs = getattr(backend, "_graphs", {})
    cache = getattr(backend, "_cache", None)
    if not device.startswith("cuda") or not graphs or cache is None:
        return {}
    graph = graphs[max(graphs, key=lambda key: key[0])][0]
    last = min(prompt_width + new_tokens, cache.columns) - iters - 1
    out = {}
    for column in sorted({min(prompt_width + new_tokens * k // 8, last) for k in (1, 4, 7)}):
        cache.column.fill_(column)
        cache.step.zero_()  # the output column of each replay; stays below iters
        out[str(column + 1)] = _replay_ms(graph, iters)  # the untimed replay wrote `column`: timed from column + 1
    return out


def build_oracle(model_dir: Path, spec: AdapterSpec, dtype: torch.dtype, device: str):
    """hf_reference (the peft model, adapter applied on the fly) with the cells' adapter: the law every backend
    must sample from."""
    from miniverl.rollout import BACKENDS

    oracle = BACKENDS.get("hf_reference")(
        model_path=str(model_dir), lora=lora_settings(spec), dtype=dtype, device=device
    )
    oracle.load_adapter(make_adapter(oracle.adapter_weights(), spec))
    return oracle


def judge_rows(oracle, prompts: list[list[int]], n: int, out: list, rows: int, stop_ids=()) -> dict:
    """The first `rows` rows (whole prompts' groups) teacher-forced through the oracle: the mean log-prob of the
    sampled tokens under the model's own law (samples from that law average minus its entropy, whichever backend
    drew them), where the backend reported log-probs the mean |reported - oracle|, and with stop tokens the stop
    hazard those rows showed beside the one the law gives their positions (`stop_mass_mean`)."""
    from lab.bench.oracle import teacher_forced

    groups = max(1, math.ceil(rows / n))
    judged_rows = out[: groups * n]
    judged, reported, masses = teacher_forced(oracle, prompts[:groups], n, judged_rows, stop_ids)
    verdict = {"rows": groups * n, "tokens": judged.numel(), "logprob_mean": float(judged.mean())}
    if all(c.logprobs for c in judged_rows):
        verdict["gap_mean"] = float((reported - judged).abs().mean())
    if masses is not None:
        verdict["stop_hazard"] = sum(c.finished for c in judged_rows) / max(1, judged.numel())
        verdict["stop_mass_mean"] = float(masses.mean())
    return verdict


def backend_class(args, cells, longest_prompt: int) -> tuple[type, dict]:
    """The class `--backend` names and its keyword arguments from `--backend-args` (raw vLLM and SGLang sized for the
    widest and longest cell), refused with the fix before any model is built."""
    from lab.bench.baselines import BASELINES
    from miniverl.rollout import BACKENDS

    try:
        kwargs = json.loads(args.backend_args)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--backend-args is not JSON ({e}): give an object, e.g. '{{\"logprobs\": false}}'") from None
    if not isinstance(kwargs, dict):
        raise SystemExit(f"--backend-args must be a JSON object of keyword arguments, got {args.backend_args!r}")
    rows, longest = max(g * n for g, n, _ in cells), longest_prompt + max(t for _, _, t in cells)  # engines' sizes
    if args.backend in BASELINES:
        if args.backend == "raw_vllm":
            kwargs = {"max_num_seqs": rows, "max_model_len": longest} | kwargs
        return BASELINES[args.backend], kwargs
    if args.backend == "sglang":  # an engine sized at start, as raw vLLM; --backend-args are rollout.sglang keys
        from lab.bench.engine_settings import sglang_settings

        try:
            kwargs = {"settings": sglang_settings(rows, longest, kwargs)}
        except ConfigError as e:
            raise SystemExit(f"--backend-args do not fit sglang: {e}") from None
    if args.backend in BACKENDS:
        return BACKENDS.get(args.backend), kwargs
    known = ", ".join(sorted([*BACKENDS.names(), *BASELINES]))
    raise SystemExit(f"--backend {args.backend!r} is not a rollout backend or a bench peer; choose one of {known}")


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    shape = real_shape(args.shape, 4096, 0) if args.shape != "tiny" else TINY
    spec = ADAPTER
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    result["args"] = vars(args)
    cells_asked = parse_cells(args.cells)
    cls, kwargs = backend_class(args, cells_asked, hi)
    if args.prefill_tokens is not None:  # hf_cached's padded tokens a prefill pass (its PREFILL_TOKENS otherwise)
        from miniverl.rollout import hf_cached

        if args.backend != "hf_cached" or args.prefill_tokens < 1:
            raise SystemExit(
                f"--prefill-tokens is hf_cached's and at least 1, got {args.prefill_tokens} for {args.backend}"
            )
        hf_cached.PREFILL_TOKENS = args.prefill_tokens
    result["prefill_tokens"] = args.prefill_tokens
    with tempfile.TemporaryDirectory(prefix="decode-profile-") as tmp:
        model_dir = build_random_model(shape, dtype, device, Path(tmp) / "model")
        try:
            backend = cls(model_path=str(model_dir), lora=lora_settings(spec), dtype=dtype, device=device, **kwargs)
        except TypeError as e:
            raise SystemExit(f"--backend-args do not fit {args.backend}: {e}") from None
        backend.load_adapter(make_adapter(backend.adapter_weights(), spec))
        result["decode_mode"] = getattr(backend, "decode_mode", None)
        cells, oracle = [], None
        for g, n, t in cells_asked:
            prompts = make_prompts(g, lo, hi, shape.vocab_size, seed=g)
            params = SamplingParams(
                n=n, max_new_tokens=t, stop_token_ids=stop_set(args.stop_median, shape.vocab_size, 7)
            )
            seeds = row_seeds(0, g * n)
            time_generate(backend, prompts, params, seeds, device, 1)  # warm-up: graphs, cuBLAS handles
            cell = {"cell": f"{g}x{n}x{t}", "stop_tokens": len(params.stop_token_ids)}
            cell["generate"], out = time_generate(backend, prompts, params, seeds, device, args.repeats)
            if args.oracle_rows > 0:
                oracle = oracle or build_oracle(model_dir, spec, dtype, device)
                cell["oracle"] = judge_rows(oracle, prompts, n, out, args.oracle_rows, params.stop_token_ids)
            if args.profile_steps > 0:
                short = SamplingParams(n=n, max_new_tokens=min(t, args.profile_steps), stop_token_ids=())
                cell["trace"] = trace(backend, prompts, short, seeds, device)
                # replays the graphs from where the short call left the decode state; after a whole call its step
                # counter sits at the buffers' end and a replay writes past them (an illegal access on the H200)
                cell["replay_ms"] = replay(backend, device)
                cell["replay_by_column"] = replay_by_column(backend, device, max(map(len, prompts)), t)
            cells.append(cell)
            print(summary_line(cell), flush=True)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "decode_profile.json").write_text(json.dumps(result | {"cells": cells}, indent=1))
        result["cells"] = cells
    return result


def summary_line(cell: dict) -> str:
    gen = cell["generate"]
    line = (
        f"{cell['cell']}: {gen['tokens_per_s']:,.0f} tok/s (wall {statistics.median(gen['wall_s']):.2f} s, mean length"
        f" {gen['lengths']['mean']:.0f}, stop hazard {gen['stop_hazard']:.4f}/token)"
    )
    if "peak_allocated_gib" in gen:
        line += f" | peak {gen['peak_allocated_gib']:.2f} GiB allocated, {gen['peak_reserved_gib']:.2f} reserved"
    if "oracle" in cell:
        ora = cell["oracle"]
        line += f" | oracle on {ora['rows']} rows: sampled log-prob mean {ora['logprob_mean']:.3f}"
        line += f", |gap| mean {ora['gap_mean']:.2e}" if "gap_mean" in ora else ""
        if "stop_mass_mean" in ora:
            line += f", stop hazard {ora['stop_hazard']:.4f} vs the law's {ora['stop_mass_mean']:.4f}"
    if "trace" not in cell:
        return line
    tr = cell["trace"]
    top = sorted(tr["kernel_ms_per_step"].items(), key=lambda kv: -kv[1])[:4]
    return (
        line + f" | trace: {tr['wall_ms_per_step']:.2f} ms/step wall,"
        f" GPU busy {tr['gpu_busy_ms_per_step']:.2f} ms ({tr['gpu_busy_fraction']:.0%}),"
        f" {tr['kernels_per_step']:.0f} kernels/step; "
        + ", ".join(f"{c} {ms:.2f}" for c, ms in top)
        + f" | replay ms by width {cell['replay_ms']}, by column {cell.get('replay_by_column', {})}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="hf_cached", help="a rollout backend or a bench peer (raw_vllm, hf_generate)")
    ap.add_argument("--backend-args", default="{}", help="JSON object of the backend's keyword arguments")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="qwen2.5-0.5b, qwen2.5-1.5b or tiny (CPU smoke)")
    ap.add_argument("--cells", default="64x4x512,256x4x512")
    ap.add_argument("--prompt-len", default="16:64", help="min:max prompt tokens (uniform)")
    ap.add_argument("--stop-median", type=int, default=0, help="median length under stop tokens (0: none)")
    ap.add_argument("--profile-steps", type=int, default=64, help="new tokens of the traced call (0: no trace)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--prefill-tokens", type=int, default=None, help="hf_cached's padded tokens a prefill pass (default: its own)"
    )
    ap.add_argument(
        "--oracle-rows", type=int, default=0, help="rows of each cell teacher-forced through hf_reference (0: none)"
    )
    run(ap.parse_args())


if __name__ == "__main__":
    main()
