"""The two passes over a chunk of [c, V] logits that the fused LM-head loss needs, one read (and one write) each.

- `row_logsumexp`: log sum_j exp(z_ij) per row, in fp32, straight from the logits' own dtype (and
  `segment_logsumexp`, the same per run of columns: rollout/sampling.py draws tokens from it);
- `scaled_softmax_`: z_ij <- exp(z_ij - base_i) * coef_i in place, computed in fp32, stored in the logits' dtype.

Everything else the loss reads of a position's logits is a gather of K + 1 columns, so with these two a chunk
costs about three passes over bf16 logits (write by the head's GEMM, read for the row sums, read and write for
the gradient) instead of the eager path's fp32 copy, two logsumexps and three in-place fp32 passes (about 50
bytes per vocabulary entry; lab/results/learner-throughput.md measured the eager passes at about a third of
the update). On CUDA they are Triton kernels; elsewhere (the CPU, or Triton missing) the same functions in
torch. `TRITON_INTERPRET=1` runs the kernels on the CPU, which is how the tests compare the two.

Shapes: c rows (positions), V vocabulary.
"""

from __future__ import annotations

import functools
import os

import torch

# Columns per program step: 4,096 values per load, so each program has many bytes in flight (a memory-bound
# pass needs tens of KB in flight per multiprocessor) while its two fp32 accumulators stay in registers.
BLOCK_COLUMNS = 4096
# Columns per program of the row sums: a [256, 152k] chunk is 256 x 10 programs rather than 256 (one per row
# would leave most of an H200's 132 multiprocessors with one or two programs); the partial sums are merged
# in torch, a [c, 10] logsumexp.
SEGMENT_COLUMNS = 4 * BLOCK_COLUMNS


@functools.cache
def _kernels():
    """The Triton kernels, or None where they cannot run (no triton, or neither CUDA nor the interpreter)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_lse(x_ptr, out_ptr, stride, n_cols, SEGMENT: tl.constexpr, BLOCK: tl.constexpr):
        # Online logsumexp of one segment of one row: a running max m and sum s of exp(x - m) per lane, merged
        # across lanes at the end; out[row, segment] = the segment's logsumexp (-inf for an all -inf segment).
        row = tl.program_id(0)
        segment = tl.program_id(1)
        base = x_ptr + row.to(tl.int64) * stride
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        for offset in range(0, SEGMENT, BLOCK):
            cols = segment * SEGMENT + offset + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, x)
            shift = tl.where(new_m == float("-inf"), 0.0, new_m)  # a lane that has seen only -inf keeps s = 0
            s = s * tl.exp(m - shift) + tl.exp(x - shift)
            m = new_m
        top = tl.max(m, 0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        tl.store(out_ptr + row * tl.num_programs(1) + segment, tl.log(tl.sum(s * tl.exp(m - shift), 0)) + shift)

    @triton.jit
    def scaled_softmax(x_ptr, base_ptr, coef_ptr, stride, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        ptr = x_ptr + row.to(tl.int64) * stride + cols
        x = tl.load(ptr, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - tl.load(base_ptr + row)) * tl.load(coef_ptr + row)
        tl.store(ptr, y.to(x_ptr.dtype.element_ty), mask=cols < n_cols)

    return row_lse, scaled_softmax


def kernels_available() -> bool:
    """Whether the Triton kernels can run on this machine's GPU (Triton installed, CUDA present)."""
    return torch.cuda.is_available() and _kernels() is not None


def _use_kernels(x: torch.Tensor) -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (x.is_cuda or interpreted) and x.dim() == 2 and x.stride(1) == 1 and _kernels() is not None


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log sum exp over each row, accumulated in fp32 (x is not copied to fp32). Shapes: [c, V] -> [c] float32."""
    if not _use_kernels(x) or x.shape[0] == 0:
        return torch.logsumexp(x.float(), dim=-1)
    return torch.logsumexp(segment_logsumexp(x, SEGMENT_COLUMNS), dim=-1)


def segment_logsumexp(x: torch.Tensor, segment: int) -> torch.Tensor:
    """log sum exp over each run of `segment` columns of each row (the last run may be short), in fp32; -inf for a
    run of only -inf. `segment` a multiple of BLOCK_COLUMNS or a power of two below it.
    Shapes: [c, V] -> [c, ceil(V / segment)] float32."""
    segments = _cdiv(x.shape[1], segment)
    if not _use_kernels(x) or x.shape[0] == 0:
        padded = torch.nn.functional.pad(x.float(), (0, segments * segment - x.shape[1]), value=float("-inf"))
        return torch.logsumexp(padded.view(x.shape[0], segments, segment), dim=-1)
    row_lse, _ = _kernels()
    partial = torch.empty(x.shape[0], segments, dtype=torch.float32, device=x.device)
    block = min(segment, BLOCK_COLUMNS)
    row_lse[(x.shape[0], segments)](x, partial, x.stride(0), x.shape[1], SEGMENT=segment, BLOCK=block)
    return partial


def scaled_softmax_(x: torch.Tensor, base: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """In place: x_ij <- exp(x_ij - base_i) * coef_i, computed in fp32 and stored in x's dtype (exp(-inf) = 0).
    Shapes: x [c, V], base [c] fp32, coef [c] fp32 -> x."""
    if not _use_kernels(x) or x.numel() == 0:
        y = (x.float() - base[:, None]).exp_().mul_(coef[:, None])
        return x.copy_(y)
    _, kernel = _kernels()
    base, coef = base.float().contiguous(), coef.float().contiguous()
    grid = (x.shape[0], _cdiv(x.shape[1], BLOCK_COLUMNS))
    kernel[grid](x, base, coef, x.stride(0), x.shape[1], BLOCK=BLOCK_COLUMNS)
    return x


def _cdiv(n: int, d: int) -> int:
    """ceil(n / d) for positive ints."""
    return -(-n // d)
