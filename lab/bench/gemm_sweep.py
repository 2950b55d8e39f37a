"""The decode step's GEMMs alone, at the shapes hf_cached runs them, in layouts and kernels that could replace the
cuBLAS choice the decode makes now (issue 32).

At 256 rows the 0.5B shape's decode step is 2.07 ms of GPU time, 1.25 ms of it GEMMs, and they run far from the
weights' bandwidth: gate/up 11.4 us a layer for 17.4 MB (1.5 TB/s), down 10.2 us for 8.7 MB (0.9 TB/s: K = 4,864,
N = 928) against the ~4.3 TB/s a device copy reaches (lab/results/decode-profile.md, "c: what is left"). This
measures each GEMM by itself so a session with little device time learns which variant to build into the decode:

    python -m lab.bench.gemm_sweep --out DIR [--shape qwen2.5-0.5b] [--rows 64,256,1024] [--rank 32]

Each GEMM is y = x W^T, x [M, K] and W [N, K] in bf16: hf_cached's fused weights (cached_decoder.py `_fuse`: the
base's output rows, then the adapter's R rows of A), and the adapter's B products (x A^T)(s B)^T, K = R. Variants:
- `linear`: F.linear(x, W), what the decode runs now;
- `pad256`: W with zero rows up to a multiple of 256 outputs (a tile-friendly N), the output sliced back;
- `kn`: x @ Wt with Wt = W^T stored [K, N] contiguous (the other operand layout cuBLAS may tile better);
- `inductor`: torch.compile(F.linear, mode="max-autotune-no-cudagraphs"): Inductor's autotuned Triton GEMMs and
  cuBLAS, the faster for this shape (CUDA only, and slow to compile: `--variants` leaves it out).
On CUDA each variant is captured in a CUDA graph of `--repeat` calls and replayed (GPU time per call, no host time
between calls, as the decode's graph runs them); on the CPU the calls are timed with the wall clock (the smoke test).
Writes gemm_sweep.json: per GEMM and variant the microseconds per call, the weight bytes read per second, and the
largest |difference| from `linear`'s output (a faster variant that changes the numbers shows it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from miniverl.models.random_init import REAL_SHAPES

VARIANTS = ("linear", "pad256", "kn", "inductor")
PAD = 256


def decode_gemms(shape: dict, rank: int, vocab: int = 151936, kv_heads: int = 2) -> dict[str, tuple[int, int]]:
    """(N, K) of every GEMM of one decode step of a REAL_SHAPES entry with a rank-`rank` adapter on every linear
    layer: the fused q/k/v, o, gate/up and down projections with their A rows, their B products, and the LM head."""
    e, i, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    kv = shape.get("num_key_value_heads", kv_heads) * (e // heads)
    return {
        "qkv+A": (e + 2 * kv + rank, e),
        "o+A": (e + rank, e),
        "gate_up+A": (2 * i + rank, e),
        "down+A": (e + rank, i),
        "qkv_B": (e + 2 * kv, rank),
        "o_B": (e, rank),
        "gate_up_B": (2 * i, rank),
        "down_B": (e, rank),
        "lm_head": (shape.get("vocab_size", vocab), e),
    }


def variant_fn(name: str, weight: torch.Tensor):
    """The call computing x W^T for `name`, with what it needs prepared outside it (as the decode would at load)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}: use one of {', '.join(VARIANTS)}")
    n = weight.shape[0]
    if name == "linear":
        return lambda x: F.linear(x, weight)
    if name == "pad256":
        padded = torch.zeros(-(-n // PAD) * PAD, weight.shape[1], dtype=weight.dtype, device=weight.device)
        padded[:n] = weight
        return lambda x: F.linear(x, padded)[:, :n]
    if name == "kn":
        kn = weight.t().contiguous()
        return lambda x: x @ kn
    compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)  # "inductor"
    return lambda x: compiled(x, weight)


def time_call(fn, x: torch.Tensor, repeat: int) -> float:
    """Microseconds per call: a CUDA graph of `repeat` calls replayed (CUDA), or the wall clock (CPU)."""
    fn(x)  # warm-up: compiles, picks the cuBLAS algorithm
    if x.device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeat):
            fn(x)
        return (time.perf_counter() - start) / repeat * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn(x)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeat


def sweep(shape: dict, rows: list[int], rank: int, variants: list[str], device: str, repeat: int) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    cells = []
    for gemm, (n, k) in decode_gemms(shape, rank).items():
        weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
            reference = F.linear(x, weight).float()
            for name in variants:
                fn = variant_fn(name, weight)
                us = time_call(fn, x, repeat)
                diff = (fn(x).float() - reference).abs().max().item()
                cell = {"gemm": gemm, "m": m, "n": n, "k": k, "variant": name, "us": us}
                cell |= {"weight_tb_per_s": n * k * 2 / us / 1e6, "max_abs_diff": diff}
                cells.append(cell)
                print(
                    f"{gemm:>10} M={m:<5} N={n:<7} K={k:<5} {name:>8}: {us:8.2f} us  {cell['weight_tb_per_s']:.2f} TB/s"
                )
    return cells


def sweep_record(module: str, argv: list[str] | None, device: str, **fields) -> dict:
    """A sweep's JSON record (this one's and bench/attention_sweep.py's): the command that ran it, the device and
    torch, then `fields`."""
    return {
        "command": f"python -m lab.bench.{module} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        **fields,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m lab.bench.gemm_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gemm_sweep.json")
    p.add_argument("--shape", default="qwen2.5-0.5b", help=f"one of {', '.join(REAL_SHAPES)} (or 'tiny' for a test)")
    p.add_argument("--rows", default="64,256,1024", help="decode widths M, comma-separated")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (the adapter's A rows in each fused weight)")
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all; on the CPU all but inductor)",
    )
    p.add_argument("--repeat", type=int, default=50, help="calls per captured graph (per timing on the CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=512)
    if a.shape != "tiny" and a.shape not in REAL_SHAPES:
        p.error(f"--shape {a.shape!r}: use one of {', '.join(REAL_SHAPES)} or tiny")
    on_gpu = a.device.startswith("cuda")
    variants = [v for v in (a.variants or ",".join(v for v in VARIANTS if on_gpu or v != "inductor")).split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; use some of {', '.join(VARIANTS)}")
    if "inductor" in variants and not on_gpu:
        p.error("--variants inductor autotunes GPU kernels: leave it out on the CPU")
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        p.error(f"--rows {a.rows!r}: give widths as integers, e.g. 64,256,1024")
    if a.rank < 1 or a.repeat < 1 or min(rows) < 1:
        p.error("--rank, --repeat and every --rows width must be >= 1")
    shape = tiny if a.shape == "tiny" else REAL_SHAPES[a.shape]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = sweep(shape, rows, a.rank, variants, a.device, a.repeat)
    result = sweep_record("gemm_sweep", argv, a.device, shape=a.shape, rank=a.rank, cells=cells)
    (out / "gemm_sweep.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
