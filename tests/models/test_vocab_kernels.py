"""The vocabulary passes (models/vocab_kernels.py): the Triton kernels against float64 references, on the CPU
through Triton's interpreter and on CUDA when there is one; and the torch fallback they replace.

Triton reads TRITON_INTERPRET when it is imported (its own library functions are built then), so the
interpreted checks run in a child process that sets it first; on CUDA they run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miniverl.models import vocab_kernels

pytest.importorskip("triton", reason="the kernels are Triton; the package ships with the dev extras")

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)
BF16_ULP = 2.0**-7  # relative spacing of bf16 values: a once-rounded result sits within one of them
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["interpret", CUDA])
def run(request):
    """run(check, *args): the check on the GPU here, or on the CPU under Triton's interpreter in a child."""

    def go(check, *args):
        if request.param == "cuda":
            return check("cuda", *args)
        code = f"from tests.models.test_vocab_kernels import {check.__name__} as c; c('cpu', *{args!r})"
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]

    return go


def logits(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random logits with the awkward cases: a vocabulary that no block size divides, a row that is -inf but
    for one id, a row whose last segments are all -inf (as a support scattered to -inf leaves them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 4
    x[1] = float("-inf")
    x[1, 7] = 3.0
    x[2, vocab // 3 :] = float("-inf")
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_row_logsumexp_matches_float64(run, dtype):
    run(check_row_logsumexp, dtype)


def check_row_logsumexp(device: str, dtype: str) -> None:
    dtype = getattr(torch, dtype)
    vocab = 2 * vocab_kernels.SEGMENT_COLUMNS + 1234  # three segments, the last one partial
    x = logits(5, vocab, dtype, device, seed=0)
    assert vocab_kernels._use_kernels(x)
    got = vocab_kernels.row_logsumexp(x)
    want = torch.logsumexp(x.double(), dim=-1)
    assert got.dtype == torch.float32 and got.device == x.device
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6), (got, want)
    assert got[1].item() == pytest.approx(3.0, abs=1e-6)  # one finite id: its own logit


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_scaled_softmax_rewrites_every_entry_within_one_rounding(run, dtype):
    run(check_scaled_softmax, dtype)


def check_scaled_softmax(device: str, dtype: str) -> None:
    dtype = getattr(torch, dtype)
    vocab = vocab_kernels.BLOCK_COLUMNS + 517
    x = logits(6, vocab, dtype, device, seed=1)
    base = torch.logsumexp(x.double(), dim=-1).float()
    coef = torch.tensor([1.0, -2.5, 0.3, 7.0, -0.01, 0.0], device=device)
    want = (x.double() - base[:, None].double()).exp() * coef[:, None].double()
    out = vocab_kernels.scaled_softmax_(x, base, coef)
    assert out.data_ptr() == x.data_ptr() and out.dtype == dtype
    # Every entry was rewritten: the input logits (up to ~16) would sit far outside this bound.
    rel = BF16_ULP if dtype == torch.bfloat16 else 1e-5  # fp32: exp of an argument up to ~30 in magnitude
    assert torch.all((out.double() - want).abs() <= rel * want.abs() + 1e-30)
    assert torch.all(out[1][torch.arange(vocab, device=device) != 7] == 0)  # exp(-inf) is 0, not NaN


def test_the_torch_fallback_serves_what_the_kernels_cannot_take(monkeypatch):
    """On the CPU without the interpreter, and for a non-contiguous row, the torch path runs (same results)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = logits(3, 1000, torch.float32, "cpu", seed=2)
    assert not vocab_kernels._use_kernels(x)
    assert not vocab_kernels._use_kernels(x.t())
    assert torch.allclose(vocab_kernels.row_logsumexp(x), torch.logsumexp(x, dim=-1))
    base, coef = torch.zeros(3), torch.full((3,), 2.0)
    want = x.exp() * 2
    assert torch.allclose(vocab_kernels.scaled_softmax_(x.clone(), base, coef), want)


def test_the_fused_head_gives_the_same_loss_and_gradient_with_the_kernels(run):
    run(check_fused_head)


def check_fused_head(device: str) -> None:
    """The closed-form GKD top-K chunk through the kernels against the torch passes, in bf16 as the learner
    runs it: same loss and log-probs to fp32 rounding, hidden-state gradients within bf16 rounding."""
    from miniverl.models.fused_head import Support, fused_head_loss

    g = torch.Generator().manual_seed(3)
    n, h, vocab, k = 40, 16, vocab_kernels.SEGMENT_COLUMNS + 300, 8
    head = torch.nn.Linear(h, vocab, bias=False).to(torch.bfloat16).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=g)
    head = head.to(device)
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randint(0, vocab, (n,), generator=g).to(device)
    support_ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)]).to(device)
    support_ids[::3, 0] = ids[::3]  # some sampled ids sit on the support
    teacher = torch.log_softmax(torch.randn(n, k + 1, generator=g), dim=-1).to(device)

    def terms(sup, tail, positions):  # forward KL against the teacher's K + tail: every input gets a gradient
        p = teacher[positions].exp()
        return (p * (teacher[positions] - torch.cat([sup, tail[:, None]], dim=-1))).sum(-1)

    def loss_fn(logprobs, term, positions):
        return term / n - 0.1 * logprobs / n

    def run():
        x = hidden.clone().requires_grad_()
        loss, lp, term = fused_head_loss(x, head, ids, 16, None, loss_fn, Support(support_ids, terms))
        loss.backward()
        return loss, lp, term, x.grad

    with_kernels = run()
    real = vocab_kernels._use_kernels
    vocab_kernels._use_kernels = lambda x: False
    try:
        eager = run()
    finally:
        vocab_kernels._use_kernels = real
    for got, want in zip(with_kernels[:3], eager[:3]):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    scale = eager[3].float().abs().max()
    assert (with_kernels[3].float() - eager[3].float()).abs().max() <= 2 * BF16_ULP * scale
