"""The decode attention kernel alone, at the widths and cache columns hf_cached runs it, in the tile and launch
settings Triton offers (issue 32).

A decode step reads every row's cache up to the column it writes, so its attention grows through a call: at 1,024
rows of the 0.5B shape (2 KV heads of 64) one column of every row's keys and values is 12.6 MB over the 24 layers,
and half-way through a 512-token call (~300 columns) the step reads ~3.8 GB of cache against ~1 GB of weights.
Whether the kernel reads it near the card's bandwidth decides how far the long-call steps are from their floor:

    python -m lab.bench.attention_sweep --out DIR [--rows 256,1024] [--columns 128,320,576]
        [--blocks 32,64,128] [--warps 2,4,8] [--stages 1,2,3]

For each width W and column count C: one layer's `decode_kernels.decode_attention` (the q/k/v GEMM output of W rows,
rotary, the new key/value written at column C - 1, the online softmax over columns 0..C-1 of each row), in every
combination of `block` (cache columns per iteration) and Triton's num_warps / num_stages, captured in a CUDA graph of
`--repeat` calls and replayed (microseconds per call), with the cache bytes it reads per second and the largest
|difference| of its output from the decode's own settings (block 64, Triton's default launch). Writes
attention_sweep.json. On the CPU the kernel runs only under Triton's interpreter (`TRITON_INTERPRET=1`): the smoke
test's tiny cells, timed by the wall clock.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from lab.bench.gemm_sweep import sweep_record, time_call
from miniverl.models.random_init import REAL_SHAPES
from miniverl.rollout import decode_kernels


def attention_inputs(rows: int, columns: int, heads: int, kv_heads: int, head_dim: int, device: str) -> dict:
    """Random inputs of one layer's call: rows whose prompts start at column 0 (every column read), the step writing
    column `columns` - 1, bf16 on CUDA (fp32 on the CPU, as the interpreter's tests run)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    width = (heads + 2 * kv_heads) * head_dim
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 6.0
    angles = torch.cat([angles, angles], dim=1)
    cache = (rows, kv_heads, columns, head_dim)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    return dict(
        y=rand(rows, width),
        t=rand(rows, width) * 0.01,
        cos=angles.cos().to(device, dtype),
        sin=angles.sin().to(device, dtype),
        keys=rand(*cache),
        values=rand(*cache),
        column=torch.tensor([columns - 1], device=device),
        first_column=torch.zeros(rows, dtype=torch.long, device=device),
        heads=heads,
        scale=head_dim**-0.5,
    )


def settings(blocks: list[int], warps: list[int], stages: list[int]) -> list[dict]:
    """Every combination, the decode's own first (block 64, Triton's default launch)."""
    own = {"block": decode_kernels.BLOCK_COLUMNS, "launch": {}}
    combos = [
        {"block": b, "launch": {"num_warps": w, "num_stages": s}}
        for b, w, s in itertools.product(blocks, warps, stages)
    ]
    return [own, *combos]


def sweep(shape: dict, rows: list[int], columns: list[int], combos: list[dict], device: str, repeat: int) -> list[dict]:
    heads, kv_heads = shape["num_attention_heads"], shape.get("num_key_value_heads", 2)
    head_dim = shape["hidden_size"] // heads
    cells = []
    for w, c in itertools.product(rows, columns):
        inputs = attention_inputs(w, c, heads, kv_heads, head_dim, device)
        reference = decode_kernels.decode_attention(**inputs).float()
        cache_bytes = 2 * w * kv_heads * c * head_dim * inputs["keys"].element_size()  # keys and values read
        for combo in combos:

            def call(_x, combo=combo, inputs=inputs):
                return decode_kernels.decode_attention(**inputs, block=combo["block"], launch=combo["launch"])

            try:
                us = time_call(call, inputs["y"], repeat)
            except Exception as e:  # a tile or launch that does not compile (registers, shared memory): recorded
                cells.append({"rows": w, "columns": c, **combo, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"rows={w:<5} columns={c:<4} {combo}: failed ({type(e).__name__})")
                continue
            diff = (call(None).float() - reference).abs().max().item()
            cell = {"rows": w, "columns": c, **combo, "us": us, "cache_tb_per_s": cache_bytes / us / 1e6}
            cells.append(cell | {"max_abs_diff": diff})
            print(f"rows={w:<5} columns={c:<4} {combo}: {us:8.2f} us  {cell['cache_tb_per_s']:.2f} TB/s")
    return cells


def _ints(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        p.error(f"{flag} {text!r}: give integers, comma-separated")
    if not values or min(values) < 1:
        p.error(f"{flag} {text!r}: every value must be >= 1")
    return values


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m lab.bench.attention_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for attention_sweep.json")
    p.add_argument("--shape", default="qwen2.5-0.5b", help=f"one of {', '.join(REAL_SHAPES)}")
    p.add_argument("--rows", default="256,1024", help="decode widths, comma-separated")
    p.add_argument("--columns", default="128,320,576", help="cache columns read by the step, comma-separated")
    p.add_argument("--blocks", default="32,64,128", help="cache columns per iteration (powers of two >= 16)")
    p.add_argument("--warps", default="2,4,8", help="Triton num_warps values")
    p.add_argument("--stages", default="1,2,3", help="Triton num_stages values")
    p.add_argument("--repeat", type=int, default=50, help="calls per captured graph (per timing on the CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    if a.shape not in REAL_SHAPES:
        p.error(f"--shape {a.shape!r}: use one of {', '.join(REAL_SHAPES)}")
    rows, columns = _ints(p, "--rows", a.rows), _ints(p, "--columns", a.columns)
    blocks = _ints(p, "--blocks", a.blocks)
    if any(b < decode_kernels.MIN_DOT or b & (b - 1) for b in blocks):
        p.error(f"--blocks {a.blocks!r}: each must be a power of two >= {decode_kernels.MIN_DOT} (tl.dot's minimum)")
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    shape = REAL_SHAPES[a.shape]
    if not decode_kernels.available(a.device, shape["hidden_size"] // shape["num_attention_heads"]):
        p.error(f"the decode kernels do not run on {a.device!r} here: a CUDA GPU with Triton (or TRITON_INTERPRET=1)")
    combos = settings(blocks, _ints(p, "--warps", a.warps), _ints(p, "--stages", a.stages))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = sweep(shape, rows, columns, combos, a.device, a.repeat)
    result = sweep_record("attention_sweep", argv, a.device, shape=a.shape, cells=cells)
    (out / "attention_sweep.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
