"""hf_cached's decode step on CUDA as twelve launches a layer: the four projection GEMM pairs and these three Triton
kernels, each doing what the eager path spreads over many launches.

Profiled on an H200 at 256 rows x 24 layers (lab/results/decode-profile.md), the eager step launched about
1,200 kernels and the GPU, not the host, set its pace: small elementwise kernels (norm casts, rotary halves,
strided LoRA sums, SiLU) and the attention's ten launches a layer, whose score GEMM read every cache column of
every row, masked or not. Here:
- `decode_attention`: from the q/k/v GEMM's output (+ the LoRA term), the rotary embedding of q and k, the step's
  key/value stored into the cache at `column`, then an online softmax over the row's own columns
  [first_column, column] only; one program per (row, KV head) serves that head's G query heads (grouped-query
  attention reads the keys once for the G of them);
- `residual_norm`: the projection's output (+ its LoRA term) added to the residual stream, and RMSNorm of the
  sum (the next sublayer's input), in one pass over a row;
- `silu_mul`: SiLU(gate) * up from the gate/up GEMM's output (+ its LoRA term);
- `hash_uniforms`: the sampler's per-row counter hash (rollout/sampling.py `counter_uniforms`) in one launch, the
  same integers, instead of about fifty small int64 ones;
- `inverse_cdf`: the sampler's two-level inverse CDF after its segment sums (rollout/sampling.py
  `_two_level_inverse_cdf`), one program per row, instead of about 25 small launches.
Each rounds where the eager bf16 path rounds (every op's result to the model's dtype; the norm's statistics and
the softmax in fp32), so the same inputs give the same values up to the order of fp32 sums (the RMS, the scores);
the attention keeps its scores in fp32 where eager rounds them to bf16 first. `TRITON_INTERPRET=1` runs the
kernels on the CPU, which is how the tests compare them with float64 references and hf_cached's fused path with
the oracle. The CPU decodes eagerly (rollout/cached_decoder.py `hidden`).

Shapes: W rows decoded, E hidden, H query heads, Hkv KV heads, G = H / Hkv, D head dim, L cache columns,
I intermediate size; a GEMM output y is [W, O + R] (the base's O columns, then x A^T's R), its LoRA term t [W, O].
"""

from __future__ import annotations

import functools
import os

import torch

BLOCK_COLUMNS = 64  # cache columns per iteration: a [64, D] key tile and a [G, 64] score tile in registers
MIN_DOT = 16  # tl.dot needs every dimension >= 16: the G query heads are padded up to it
BLOCK_INTERMEDIATE = 1024  # SiLU * up: columns per program
# Triton 3.9's interpreter multiplies bf16 tl.dot operands wrongly (off by 1e10 on 16 x 16 random values): under
# it the dots widen their operands to fp32 first (the values are the same; the products are exact in fp32).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels():
    """The Triton kernels (attention, residual norm, SiLU mul, the sampler's hash), or None without triton."""
    try:
        from miniverl.rollout import decode_triton
    except ImportError:
        return None
    return (
        decode_triton.decode_attention_kernel,
        decode_triton.residual_norm_kernel,
        decode_triton.silu_mul_kernel,
        decode_triton.hash_uniform_kernel,
        decode_triton.inverse_cdf_kernel,
    )


def available(device: str, head_dim: int) -> bool:
    """Whether the kernels serve this device: CUDA (or Triton's interpreter) with Triton installed, and a head dim
    tl.dot takes (a power of two from 16 to 256)."""
    shape_ok = head_dim >= MIN_DOT and head_dim <= 256 and head_dim & (head_dim - 1) == 0
    return (device.startswith("cuda") or _INTERPRETED) and shape_ok and _kernels() is not None


def _lora(y: torch.Tensor, t: torch.Tensor | None) -> tuple[torch.Tensor, int, bool]:
    """The LoRA term's pointer, row stride and presence (y stands in for an absent one: never read)."""
    if y.stride(-1) != 1 or (t is not None and t.stride(-1) != 1):
        raise ValueError("the decode kernels need each row's columns contiguous")
    return (y, 0, False) if t is None else (t, t.stride(0), True)


def decode_attention(
    y: torch.Tensor,
    t: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    column: torch.Tensor,
    first_column: torch.Tensor,
    heads: int,
    scale: float,
    *,
    block: int = BLOCK_COLUMNS,
    launch: dict | None = None,
) -> torch.Tensor:
    """Attention of one decode step from the q/k/v GEMM's output: q, k and v (y + t, in heads of D columns: H
    query heads, then Hkv key heads, then Hkv value heads), q and k rotated by cos/sin, k and v written into the
    cache at `column` for the W rows, then each row's queries attend over its columns [first_column, column].
    `block` (cache columns per iteration, a power of two >= 16) and `launch` (Triton's num_warps / num_stages) are
    what lab/bench/attention_sweep.py varies; the decode runs the defaults.

    Shapes: y [W, >= (H + 2 Hkv) D], t [W, (H + 2 Hkv) D] or None, cos/sin [W, D], keys/values [R >= W, Hkv, L,
    D] contiguous, column [1] long, first_column [R] long -> [W, H * D] in y's dtype.
    """
    w, d = cos.shape
    hkv = keys.shape[1]
    g = heads // hkv
    lora, lora_row, has_lora = _lora(y, t)
    if not keys.is_contiguous() or not values.is_contiguous() or keys.stride() != values.stride():
        raise ValueError("decode_attention needs contiguous key/value caches of one layout")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("decode_attention needs cos and sin of one layout, each row contiguous")
    out = torch.empty(w, heads * d, dtype=y.dtype, device=y.device)
    _kernels()[0][(w, hkv)](
        y, lora, cos, sin, keys, values, out, first_column, column,
        y.stride(0), lora_row, cos.stride(0), keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0), scale,
        H=heads, HKV=hkv, G=g, GP=max(MIN_DOT, 1 << (g - 1).bit_length()), D=d, BLOCK=block,
        HAS_LORA=has_lora, IEEE=y.dtype == torch.float32 or _INTERPRETED, **(launch or {}),
    )  # fmt: skip
    return out


def residual_norm(
    y: torch.Tensor, t: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h + (y + t) (the residual stream after a sublayer) and RMSNorm of it times `weight` (the next sublayer's
    input). Shapes: y [W, >= E], t [W, E] or None, h [W, E] -> ([W, E], [W, E]) in h's dtype."""
    w, n = h.shape
    lora, lora_row, has_lora = _lora(y, t)
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    _kernels()[1][(w,)](
        y, lora, h, weight, h_out, x_out, y.stride(0), lora_row, h.stride(0), n, eps,
        BLOCK=1 << (n - 1).bit_length(), HAS_LORA=has_lora,
    )  # fmt: skip
    return h_out, x_out


def silu_mul(y: torch.Tensor, t: torch.Tensor | None, intermediate: int) -> torch.Tensor:
    """SiLU(gate) * up, gate and up the first and second `intermediate` columns of y + t.
    Shapes: y [W, >= 2 I], t [W, 2 I] or None -> [W, I] in y's dtype."""
    w = y.shape[0]
    lora, lora_row, has_lora = _lora(y, t)
    out = torch.empty(w, intermediate, dtype=y.dtype, device=y.device)
    grid = (w, -(-intermediate // BLOCK_INTERMEDIATE))
    _kernels()[2][grid](y, lora, out, y.stride(0), lora_row, intermediate, BLOCK=BLOCK_INTERMEDIATE, HAS_LORA=has_lora)
    return out


HASH_BLOCK = 1024  # rows per program of hash_uniforms


def _runs_on(t: torch.Tensor) -> bool:
    """Whether the sampler's kernels serve a tensor there: CUDA (or Triton's interpreter) with Triton installed."""
    return (t.is_cuda or _INTERPRETED) and _kernels() is not None


def hash_uniforms(
    seeds: torch.Tensor, step: torch.Tensor | int, stream: int, multipliers: tuple[int, int], bits: int
) -> torch.Tensor | None:
    """rollout/sampling.py's counter_uniforms as one kernel (the same integer hash, so the same numbers), or None
    where it does not run (not CUDA nor Triton's interpreter, or no triton): the caller's torch ops then. In torch the
    hash is about fifty launches of a few int64 ops each, 56 us of a 2.07 ms decode step at 256 rows
    (lab/results/decode-profile.md, the 2026-12-04 trace at d534842).

    Shapes: seeds [B] int64 >= 0, step [] / [1] int64 tensor or int -> [B] float32."""
    if not _runs_on(seeds) or seeds.numel() == 0:
        return None
    if not isinstance(step, torch.Tensor):
        step = torch.tensor([step], dtype=torch.int64, device=seeds.device)
    seeds = seeds.contiguous()
    out = torch.empty(seeds.shape, dtype=torch.float32, device=seeds.device)
    _kernels()[3][(-(-seeds.numel() // HASH_BLOCK),)](
        seeds, step, out, seeds.numel(),
        STREAM=stream, C0=multipliers[0], C1=multipliers[1], BITS=bits, BLOCK=HASH_BLOCK,
    )  # fmt: skip
    return out


def inverse_cdf(
    x: torch.Tensor, seg: torch.Tensor, u: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rollout/sampling.py `_two_level_inverse_cdf` after its segment sums, one program per row: the segments'
    CDF, the segment holding u times the row's mass, the CDF of that segment's `width` columns and the column in it;
    or None where it does not run (the caller's torch ops then). The same steps in the same order; its exp and log
    are Triton's, so a draw may land one column over where torch's CDF and this one straddle the target (both are
    the inverse CDF of the same distribution), and the CPU never runs it outside the tests' interpreter.

    Shapes: x [B, V], seg [B, S] float32, u [B] float32 -> tokens [B] long, log of the row's mass [B] float32."""
    if not _runs_on(x) or x.shape[0] == 0 or x.stride(1) != 1:
        return None
    rows, segments = seg.shape
    seg, u = seg.contiguous(), u.contiguous()
    tokens = torch.empty(rows, dtype=torch.long, device=x.device)
    total = torch.empty(rows, dtype=torch.float32, device=x.device)
    _kernels()[4][(rows,)](
        x, seg, u, tokens, total, x.stride(0), seg.stride(0), x.shape[1], segments, torch.finfo(torch.float32).tiny,
        SP=max(MIN_DOT, 1 << (segments - 1).bit_length()), WIDTH=width,
    )  # fmt: skip
    return tokens, total
