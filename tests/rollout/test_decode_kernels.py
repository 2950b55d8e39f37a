"""The decode attention kernel (rollout/decode_kernels.py) against a float64 reference, on the CPU through Triton's
interpreter (a child process: Triton reads TRITON_INTERPRET when imported) and on CUDA when there is one; and
hf_cached's kernel path, interpreted, against the oracle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the kernel is Triton; the package ships with the dev extras")

ROOT = Path(__file__).resolve().parents[2]
CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


def in_child(code: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(params=["interpret", CUDA])
def run(request):
    def go(check, *args):
        if request.param == "cuda":
            return check("cuda", *args)
        in_child(f"from tests.rollout.test_decode_kernels import {check.__name__} as c; c('cpu', *{args!r})")

    return go


def eager_qkv(y, t, cos, sin, heads, kv_heads, head_dim):
    """q, k, v as the eager decoder computes them from a q/k/v GEMM's output (rollout/cached_decoder.py)."""
    from miniverl.rollout.cached_decoder import _rotate

    qkv = (y[:, : t.shape[1]] + t).view(y.shape[0], 1, heads + 2 * kv_heads, head_dim)
    qk = _rotate(qkv[:, :, : heads + kv_heads], cos[:, None, None], sin[:, None, None])
    return qk[:, 0, :heads], qk[:, 0, heads:], qkv[:, 0, heads + kv_heads :]


def reference(q, k_new, v_new, keys, values, column, first_column, scale):
    """Float64 GQA attention of each row over its columns [first, column] after writing the new key/value.
    Shapes: -> out [W, H * D], keys and values as written."""
    keys, values = keys.clone().double(), values.clone().double()
    w, h, d = q.shape
    hkv = keys.shape[1]
    keys[:w, :, column] = k_new.double()
    values[:w, :, column] = v_new.double()
    out = torch.empty(w, h, d, dtype=torch.float64)
    for r in range(w):
        cols = slice(int(first_column[r]), column + 1)
        for head in range(h):
            kv = head // (h // hkv)
            s = keys[r, kv, cols] @ q[r, head].double() * scale
            out[r, head] = torch.softmax(s, 0) @ values[r, kv, cols]
    return out.reshape(w, h * d), keys, values


def eager_attention(q, k_new, v_new, keys, values, column, first_column) -> torch.Tensor:
    """The eager decode path's attention in the inputs' dtype (rollout/hf_cached.py without the kernels).
    Shapes: -> [W, H * D] float64."""
    from miniverl.rollout.cached_decoder import CachedDecoder

    w, h, d = q.shape
    keys, values = keys[:w].clone(), values[:w].clone()
    keys[:, :, column], values[:, :, column] = k_new, v_new
    cols = torch.arange(keys.shape[2])
    visible = (cols >= first_column[:w, None]) & (cols <= column)
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None, :]
    decoder = CachedDecoder.__new__(CachedDecoder)  # attend reads only the head counts and the scale
    decoder.heads, decoder.kv_heads, decoder.scaling = h, keys.shape[1], d**-0.5
    return decoder.attend(q[:, :, None], keys, values, bias).reshape(w, h * d).double()


def check_against_float64(device: str, dtype: str, heads: int, kv_heads: int, head_dim: int) -> None:
    from miniverl.rollout.decode_kernels import decode_attention

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    rows, width, columns, column = 7, 5, 150, 131  # a width below the cache's rows; a column past two blocks
    keys = torch.randn(rows, kv_heads, columns, head_dim, generator=g).to(dt)
    values = torch.randn(rows, kv_heads, columns, head_dim, generator=g).to(dt)
    o, rank = (heads + 2 * kv_heads) * head_dim, 8
    y = torch.randn(width, o + rank, generator=g).to(dt)  # a GEMM output: the base's columns, then x A^T's
    t = (torch.randn(width, o, generator=g) * 0.1).to(dt)
    angles = torch.rand(width, head_dim // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = torch.cat([angles.cos()] * 2, 1).to(dt), torch.cat([angles.sin()] * 2, 1).to(dt)
    first = torch.tensor([0, 5, 64, 130, 77, 0, 0])  # 130: the new column and one cached one
    scale = head_dim**-0.5
    q, k_new, v_new = eager_qkv(y, t, cos, sin, heads, kv_heads, head_dim)
    want, _, _ = reference(q, k_new, v_new, keys, values, column, first, scale)
    keys_d, values_d = keys.to(device), values.to(device)
    col = torch.tensor([column], device=device)
    args = (cos.to(device), sin.to(device), keys_d, values_d, col, first.to(device), heads, scale)
    got = decode_attention(y.to(device), t.to(device), *args).cpu()
    # The bound: the eager bf16 path's own error against float64 (it rounds the scores too), twice over.
    tol = (
        1e-5
        if dt == torch.float32
        else 2 * (eager_attention(q, k_new, v_new, keys, values, column, first) - want).abs().max()
    )
    assert got.dtype == dt and got.shape == want.shape
    assert (got.double() - want).abs().max() < tol, ((got.double() - want).abs().max(), tol)
    # q/k/v, the LoRA sum and the rotary embedding rounded as eager's: in bf16 the cache holds eager's exact values;
    # in fp32 nothing rounds in between, and the GPU's compiler contracts x cos + r sin into one FMA (one rounding
    # fewer than eager's two ops: 1-ulp differences, seen on the H200)
    written = keys_d.cpu()[:width, :, column]
    if dt == torch.float32:
        assert torch.allclose(written, k_new, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(written, k_new)
    assert torch.equal(values_d.cpu()[:width, :, column], v_new)
    assert torch.equal(keys_d.cpu()[width:], keys[width:])  # rows past the width untouched
    untouched = torch.ones(columns, dtype=torch.bool)
    untouched[column] = False
    assert torch.equal(keys_d.cpu()[:, :, untouched], keys[:, :, untouched])
    if dt == torch.float32:  # without an adapter
        plain = decode_attention(y.to(device), None, *args).cpu()
        q0, k0, v0 = eager_qkv(y, torch.zeros_like(t), cos, sin, heads, kv_heads, head_dim)
        assert (plain.double() - reference(q0, k0, v0, keys, values, column, first, scale)[0]).abs().max() < tol


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim"),
    [("float32", 14, 2, 64), ("bfloat16", 14, 2, 64), ("float32", 4, 4, 16), ("bfloat16", 12, 2, 128)],
    ids=["fp32-gqa7", "bf16-gqa7", "fp32-mha", "bf16-gqa6-d128"],
)
def test_decode_attention_matches_float64(run, dtype, heads, kv_heads, head_dim):
    run(check_against_float64, dtype, heads, kv_heads, head_dim)


def check_residual_norm_and_silu(device: str, dtype: str) -> None:
    """Against the eager ops they replace (rollout/cached_decoder.py): bf16 results within one rounding step
    (the RMS is a sum in another order), fp32 to 1e-6."""
    import torch.nn.functional as F

    from miniverl.rollout.cached_decoder import _rms_norm
    from miniverl.rollout.decode_kernels import residual_norm, silu_mul

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(1)
    rows, hidden, inter, rank = 6, 96, 200, 8  # neither a power of two; I spans several column blocks below
    y = torch.randn(rows, hidden + rank, generator=g).to(dt)
    t = (torch.randn(rows, hidden, generator=g) * 0.1).to(dt)
    h = torch.randn(rows, hidden, generator=g).to(dt)
    weight = (1 + torch.randn(hidden, generator=g) * 0.1).to(dt)
    want_h = h + (y[:, :hidden] + t)
    want_x = _rms_norm(want_h, weight, 1e-6)
    got_h, got_x = residual_norm(y.to(device), t.to(device), h.to(device), weight.to(device), 1e-6)
    assert torch.equal(got_h.cpu(), want_h)
    ulp = 2.0**-7 if dt == torch.bfloat16 else 1e-6
    assert ((got_x.cpu().float() - want_x.float()).abs() <= ulp * want_x.float().abs().clamp(min=1)).all()
    got_plain = residual_norm(y.to(device), None, h.to(device), weight.to(device), 1e-6)[0].cpu()
    assert torch.equal(got_plain, h + y[:, :hidden])

    y2 = torch.randn(rows, 2 * inter + rank, generator=g).to(dt)
    t2 = (torch.randn(rows, 2 * inter, generator=g) * 0.1).to(dt)
    gate, up = (y2[:, : 2 * inter] + t2).chunk(2, dim=-1)
    want_m = F.silu(gate) * up
    got_m = silu_mul(y2.to(device), t2.to(device), inter).cpu()
    assert ((got_m.float() - want_m.float()).abs() <= ulp * want_m.float().abs().clamp(min=1)).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_residual_norm_and_silu_match_the_eager_ops(run, dtype):
    run(check_residual_norm_and_silu, dtype)


def test_availability_follows_device_and_head_dim(monkeypatch):
    from miniverl.rollout import decode_kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not decode_kernels.available("cpu", 64)  # the CPU decodes eagerly
    assert not decode_kernels.available("cuda", 48)  # not a power of two: eager
    assert not decode_kernels.available("cuda", 8)  # below tl.dot's 16
    assert decode_kernels.available("cuda", 64)


def check_hf_cached_kernel_path(model_dir: str) -> None:
    """hf_cached with the kernel (interpreted) samples what the oracle samples, stop tokens and all."""
    from miniverl.rollout.hf_cached import HFCachedBackend
    from miniverl.rollout.hf_reference import HFReferenceBackend
    from miniverl.rollout.sampling import SamplingParams, row_seeds
    from tests.rollout.test_hf_cached import LORA, random_adapter

    torch.set_num_threads(1)
    ref = HFReferenceBackend(model_dir, LORA, torch.float32, "cpu")
    fast = HFCachedBackend(model_dir, LORA, torch.float32, "cpu")
    assert fast.decode_mode == "eager+fused_kernels"
    adapter = random_adapter(ref.adapter_weights(), 3)
    ref.load_adapter(adapter)
    fast.load_adapter(adapter)
    prompts = [[5, 9, 17, 3], [40], [7, 7, 7, 7, 7, 7, 7, 2, 61], [30, 31]]  # prompt lengths 1 to 9
    # stop tokens an eighth of the vocabulary: rows stop at different steps and some run to the end (the
    # interpreter takes seconds a step, so one call covers both)
    params = SamplingParams(n=2, max_new_tokens=8, stop_token_ids=tuple(range(4, 12)), seed=2)
    seeds = row_seeds(2, 8)
    want, got = ref.generate(prompts, params, seeds), fast.generate(prompts, params, seeds)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finished for c in got] == [c.finished for c in want]
    gap = max(abs(a - b) for x, y in zip(want, got) for a, b in zip(x.logprobs, y.logprobs))
    assert gap < 1e-4, gap
    assert any(c.finished for c in got) and not all(c.finished for c in got)
    assert len({len(c.token_ids) for c in got}) > 2


def test_hf_cached_kernel_path_samples_what_the_oracle_samples(tmp_path):
    from tests.random_models import save_random_qwen2

    model_dir = save_random_qwen2(tmp_path / "d16", hidden_size=64, intermediate_size=128, vocab_size=64)  # D = 16
    check = "from tests.rollout.test_decode_kernels import check_hf_cached_kernel_path as c"
    in_child(f"{check}; c({str(model_dir)!r})")


def check_hash_uniforms(device: str) -> None:
    """The sampler's counter hash as one kernel gives the torch ops' numbers exactly: seeds using all 63 bits, the
    step as a device tensor (as the captured decode step holds it) and as an int, more rows than one program."""
    from miniverl.rollout import sampling
    from miniverl.rollout.decode_kernels import hash_uniforms

    g = torch.Generator().manual_seed(3)
    seeds = torch.cat([
        torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1]),
        torch.randint(0, 2**62, (2000,), generator=g),
    ])  # fmt: skip
    args = (sampling.STREAM_KEY, sampling.MIX_MULTIPLIERS, sampling.UNIFORM_BITS)
    for step in (0, 7, 2**31 + 5, torch.tensor([12345])):
        want = sampling._hashed_uniforms(seeds, step)  # the torch ops
        dev_step = step.to(device) if isinstance(step, torch.Tensor) else step
        got = hash_uniforms(seeds.to(device), dev_step, *args)
        assert got is not None and torch.equal(got.cpu(), want), step
        assert torch.equal(sampling.counter_uniforms(seeds.to(device), dev_step).cpu(), want)


def test_the_samplers_hash_as_one_kernel_draws_the_same_numbers(run):
    run(check_hash_uniforms)
    from miniverl.rollout.decode_kernels import hash_uniforms

    assert hash_uniforms(torch.tensor([1, 2]), 0, 1, (3, 5), 24) is None  # a CPU tensor: the caller's torch ops


def check_inverse_cdf(device: str) -> None:
    """The sampler's two-level inverse CDF as one kernel picks the torch steps' tokens and the same row mass: a
    vocabulary of several 4,096-column segments with a short last one, peaked and flat rows, u near 0 and 1, and a
    vocabulary narrower than one segment."""
    from miniverl.rollout import sampling
    from miniverl.rollout.decode_kernels import inverse_cdf

    g = torch.Generator().manual_seed(5)
    for rows, vocab, dtype in ((33, 3 * 4096 + 100, torch.bfloat16), (9, 64, torch.float32)):
        x = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        x[0, 17] = 40.0  # one token holds almost all the mass
        x[1] = 0.0  # flat
        u = torch.rand(rows, generator=g)
        u[2], u[3] = 0.0, 1.0 - 2.0**-24
        width = min(sampling.SAMPLE_SEGMENT, 1 << max(0, vocab - 1).bit_length())
        seg = sampling.segment_logsumexp(x, width)
        want, total = sampling._segment_inverse_cdf(x, seg, u, width)  # the torch ops
        got = inverse_cdf(x.to(device), seg.to(device), u.to(device), width)
        assert got is not None
        assert torch.equal(got[0].cpu(), want), (got[0].cpu() != want).nonzero()
        assert torch.allclose(got[1].cpu(), total, rtol=1e-6, atol=1e-6)
        assert got[0][0].item() == 17


def test_the_samplers_inverse_cdf_as_one_kernel_picks_the_same_tokens(run):
    run(check_inverse_cdf)
    from miniverl.rollout.decode_kernels import inverse_cdf

    x = torch.zeros(2, 8)
    assert inverse_cdf(x, torch.zeros(2, 1), torch.zeros(2), 8) is None  # a CPU tensor: the caller's torch ops
