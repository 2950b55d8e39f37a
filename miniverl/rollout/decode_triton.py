"""The Triton kernels of rollout/decode_kernels.py (which says what they do and how they round), in a module of
their own: Triton resolves the helpers a kernel calls among its module's globals, and only this module imports
triton, when the kernels are first needed."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """x as the model's dtype holds it, back in fp32: what eager's op-by-op rounding leaves. bf16 by hand, round to
    nearest even on the bits as torch rounds (the GPU's conversion rounds so too; Triton 3.9's interpreter
    truncates, which the CPU tests would otherwise see as one-ulp differences)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x stored in the model's dtype, rounded as torch rounds (see `rounded`)."""
    return rounded(x, dtype).to(dtype)


@triton.jit
def load_sum(y_ptr, t_ptr, offsets, mask, HAS_LORA: tl.constexpr, dtype: tl.constexpr):
    """The projection's output at `offsets`: y (base + bias), plus the LoRA term, rounded as eager's add."""
    x = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_LORA:
        x = rounded(x + tl.load(t_ptr + offsets, mask=mask, other=0.0).to(tl.float32), dtype)
    return x


@triton.jit
def rotated(y_ptr, t_ptr, cos_ptr, sin_ptr, heads, d, mask, D: tl.constexpr, HAS_LORA: tl.constexpr,
            dtype: tl.constexpr):  # fmt: skip
    """Rotary embedding of the heads at column blocks `heads` of y ("rotate half": x cos + [-x2, x1] sin),
    each product and the sum rounded as eager's. Shapes: heads [N] -> [N, D] fp32."""
    half: tl.constexpr = D // 2
    partner = (d + half) % D
    sign = tl.where(d < half, -1.0, 1.0)
    x = load_sum(y_ptr, t_ptr, heads[:, None] * D + d[None, :], mask, HAS_LORA, dtype)
    xp = load_sum(y_ptr, t_ptr, heads[:, None] * D + partner[None, :], mask, HAS_LORA, dtype)
    cos = tl.load(cos_ptr + d).to(tl.float32)
    sin = tl.load(sin_ptr + d).to(tl.float32)
    return rounded(rounded(x * cos[None, :], dtype) + rounded(sign[None, :] * xp * sin[None, :], dtype), dtype)


@triton.jit
def decode_attention_kernel(
    y_ptr, t_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, out_ptr, first_ptr, col_ptr,
    y_row, t_row, cs_row, c_row, c_head, c_col, out_row, scale,
    H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, HAS_LORA: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    col = tl.load(col_ptr)
    first = tl.load(first_ptr + row)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    real = g < G  # padded query heads compute zeros and are not stored
    y_at, t_at = y_ptr + row * y_row, t_ptr + row * t_row
    cos_at, sin_at = cos_ptr + row * cs_row, sin_ptr + row * cs_row
    q = rotated(y_at, t_at, cos_at, sin_at, head * G + g, d, real[:, None], D, HAS_LORA, dtype)  # [GP, D]
    one = tl.arange(0, 1)
    kn = rotated(y_at, t_at, cos_at, sin_at, H + head + one, d, one[:, None] >= 0, D, HAS_LORA, dtype)
    kn = tl.sum(kn, 0)  # [D]: the one key head
    vn = load_sum(y_at, t_at, (H + HKV + head) * D + d, d >= 0, HAS_LORA, dtype)  # [D]
    kc = k_ptr + row * c_row + head * c_head
    vc = v_ptr + row * c_row + head * c_head
    tl.store(kc + col * c_col + d, cast(kn, dtype))  # the cache keeps them for the steps after this one
    tl.store(vc + col * c_col + d, cast(vn, dtype))
    q = cast(q, dtype)
    # The new column first (always visible): it starts the running max, sum and output.
    m = tl.sum(q.to(tl.float32) * kn[None, :], 1) * scale  # [GP]
    total = tl.full((GP,), 1.0, tl.float32)
    acc = tl.zeros((GP, D), tl.float32) + vn[None, :]
    for start in range(first, col, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        seen = cols < col
        k = tl.load(kc + cols[:, None] * c_col + d[None, :], mask=seen[:, None], other=0.0)  # [BLOCK, D]
        if IEEE:  # fp32 operands (or bf16 ones widened under the interpreter): no tf32 rounding
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(seen[None, :], s * scale, float("-inf"))  # [GP, BLOCK]
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(vc + cols[:, None] * c_col + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:  # noqa: SIM108 (Triton)
            pv = tl.dot(rounded(p, dtype), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(cast(p, dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / total[:, None]
    tl.store(out_ptr + row * out_row + (head * G + g)[:, None] * D + d[None, :], cast(out, dtype), mask=real[:, None])


@triton.jit
def residual_norm_kernel(
    y_ptr, t_ptr, h_ptr, w_ptr, h_out_ptr, x_out_ptr, y_row, t_row, h_row, n, eps,
    BLOCK: tl.constexpr, HAS_LORA: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    dtype = h_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    out = load_sum(y_ptr + row * y_row, t_ptr + row * t_row, cols, mask, HAS_LORA, dtype)
    h = rounded(tl.load(h_ptr + row * h_row + cols, mask=mask, other=0.0).to(tl.float32) + out, dtype)
    tl.store(h_out_ptr + row * n + cols, cast(h, dtype), mask=mask)
    normed = rounded(h * (1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)), dtype)  # RMSNorm in fp32, then cast
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_out_ptr + row * n + cols, cast(w * normed, dtype), mask=mask)


@triton.jit
def silu_mul_kernel(y_ptr, t_ptr, out_ptr, y_row, t_row, n, BLOCK: tl.constexpr, HAS_LORA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = load_sum(y_ptr + row * y_row, t_ptr + row * t_row, cols, mask, HAS_LORA, dtype)
    up = load_sum(y_ptr + row * y_row, t_ptr + row * t_row, n + cols, mask, HAS_LORA, dtype)
    act = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * n + cols, cast(act * up, dtype), mask=mask)


@triton.jit
def mix32(x, C0: tl.constexpr, C1: tl.constexpr):
    """rollout/sampling.py's `_mix32` on uint64 values below 2**32: each product stays below 2**64 and is masked back
    to 32 bits, so the integers are sampling.py's exactly."""
    x = x ^ (x >> 16)
    x = (x * C0) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * C1) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def hash_uniform_kernel(
    seed_ptr, step_ptr, out_ptr, n,
    STREAM: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    seed = tl.load(seed_ptr + i, mask=live, other=0).to(tl.uint64)  # seeds are >= 0: the same bits
    step = tl.load(step_ptr).to(tl.uint64)
    h = mix32((seed & 0xFFFFFFFF) ^ STREAM, C0, C1)
    h = mix32(h ^ (seed >> 32), C0, C1)
    h = mix32(h ^ (step & 0xFFFFFFFF), C0, C1)
    tl.store(out_ptr + i, (h >> (32 - BITS)).to(tl.float32) * (1.0 / (1 << BITS)), mask=live)


@triton.jit
def inverse_cdf_kernel(
    x_ptr, seg_ptr, u_ptr, token_ptr, total_ptr, x_row, seg_row, v, segments, tiny,
    SP: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SP)
    seg = tl.load(seg_ptr + row * seg_row + j, mask=j < segments, other=float("-inf"))  # [SP]
    top = tl.max(seg, 0)
    total = top + tl.log(tl.sum(tl.exp(seg - top), 0))  # log of the row's whole mass
    cdf = tl.cumsum(tl.exp(seg - total), 0)  # [SP]: past the last segment it stays at the last value
    last = tl.sum(tl.where(j == segments - 1, cdf, 0.0), 0)
    target = tl.maximum(tl.load(u_ptr + row) * last, tiny)
    s = tl.minimum(tl.sum((cdf < target).to(tl.int32), 0), segments - 1)  # searchsorted (left) on a monotone cdf
    before = tl.sum(tl.where(j == s - 1, cdf, 0.0), 0)  # 0 for the first segment
    cols = s * WIDTH + tl.arange(0, WIDTH)
    inside = tl.load(x_ptr + row * x_row + cols, mask=cols < v, other=float("-inf")).to(tl.float32)
    inner = tl.cumsum(tl.exp(inside - total), 0) + before  # [WIDTH] absolute CDF
    aim = tl.minimum(target, tl.max(inner, 0))  # never past the segment's own last value
    pick = tl.minimum(tl.sum((inner < aim).to(tl.int32), 0), WIDTH - 1)
    tl.store(token_ptr + row, (s * WIDTH + pick).to(tl.int64))
    tl.store(total_ptr + row, total)
