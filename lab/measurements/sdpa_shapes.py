"""What a new attention shape costs, with torch's SDPA allowed cuDNN (its default on Hopper) and with flash only.

    PYTHONPATH=. python lab/measurements/sdpa_shapes.py --out sdpa.json [--shapes 12] [--repeats 2]

The learner's and teacher's micro-batches at the 4080 recipe's 0.5B shape (14 query heads, 2 key/value heads, head
dim 64, bf16, causal, no mask: transformers' call on packed rows), at about 14,305 tokens a micro-batch: `--shapes`
row lengths drawn from 100..834 (rows = 14,305 // length), each first run forward and backward (a new shape) and then
`--repeats` times more (a shape seen before). Prints and writes one JSON record: torch's and cuDNN's versions, SDPA's
priority order and the backend it picks for these inputs, and per variant the median milliseconds of a first call
and of a repeated one. peers.md run 9's learner and teacher ran ~30 new shapes a step; if cuDNN plans each one (torch
2.9+ tries cuDNN first on sm90/sm100), `first` is far above `repeat` with cuDNN allowed and not with flash only.
Needs a GPU; `--device cpu` runs the math kernel on tiny shapes (a smoke test of the script, no answer).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--shapes", type=int, default=12, help="new row lengths to time")
    p.add_argument("--repeats", type=int, default=2, help="calls of each shape after its first")
    p.add_argument("--tokens", type=int, default=14305, help="tokens a micro-batch (rows = tokens // length)")
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    if a.shapes < 1 or a.repeats < 1 or a.tokens < 834:
        p.error(f"--shapes={a.shapes} --repeats={a.repeats} --tokens={a.tokens}: need >= 1, >= 1 and >= 834")
    return a


def time_call(q, k, v, sync) -> float:
    import torch.nn.functional as F

    sync()
    start = time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
    sync()
    return (time.perf_counter() - start) * 1e3


def run_variant(cudnn: bool, lengths: list[int], a: argparse.Namespace) -> dict:
    import torch

    cuda = a.device == "cuda"
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, dim = (14, 2, 64) if cuda else (4, 2, 8)
    first, repeat = [], []
    for length in lengths:
        rows = max(1, a.tokens // length) if cuda else 2
        shape = (rows, heads, length, dim)
        q = torch.randn(shape, device=a.device, dtype=dtype, requires_grad=True)
        k, v = (
            torch.randn(rows, kv_heads, length, dim, device=a.device, dtype=dtype, requires_grad=True) for _ in "kv"
        )
        first.append(time_call(q, k, v, sync))
        repeat.extend(time_call(q, k, v, sync) for _ in range(a.repeats))
    return {
        "cudnn_allowed": cudnn,
        "first_ms_median": statistics.median(first),
        "repeat_ms_median": statistics.median(repeat),
        "first_ms": first,
        "repeat_ms": repeat,
    }


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("sdpa_shapes: no CUDA device here; run it on the GPU (or --device cpu for a smoke test)")
    rng = random.Random(0)
    # Each variant its own lengths: a length the other variant ran is not new to a shared cache
    draws = {cudnn: rng.sample(range(100, 835), a.shapes) for cudnn in (True, False)}
    record: dict = {
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if a.device == "cuda" else None,
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
    }
    if a.device == "cuda":  # torch settles its CUDA priority order at the first choice it makes: ask first
        q = torch.randn(16, 14, 512, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(16, 2, 512, 64, device="cuda", dtype=torch.bfloat16)
        choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True)
        record["picked_by_default"] = BACKEND_NAMES.get(int(choice), str(choice))
    record["priority_order"] = [BACKEND_NAMES.get(b, str(b)) for b in torch._C._get_sdp_priority_order()]
    record["variants"] = [run_variant(cudnn, draws[cudnn], a) for cudnn in (True, False)]
    torch.backends.cuda.enable_cudnn_sdp(True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    brief = {k: v for k, v in record.items() if k != "variants"}
    for variant in record["variants"]:
        brief["cudnn allowed" if variant["cudnn_allowed"] else "flash only"] = (
            f"first {variant['first_ms_median']:.1f} ms, repeat {variant['repeat_ms_median']:.1f} ms"
        )
    print(json.dumps(brief), flush=True)
    return record


if __name__ == "__main__":
    main()
