"""Sampling (rollout/sampling.py): the counter-based draws, tested on the draws themselves, and the two-level
inverse CDF against the one-level one and against the distribution it samples."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.rollout import sampling
from miniverl.rollout.sampling import SamplingParams, counter_uniforms, row_seeds, sample_next
from miniverl.seeds import PURPOSE_STRIDE, sampling_seed


def test_draws_are_uniform_and_a_pure_function_of_seed_and_step():
    seeds = torch.arange(200_000)
    u = counter_uniforms(seeds, 7)
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=100, min=0, max=1)  # chi-square over 100 bins, 99 degrees of freedom
    chi2 = ((counts - 2000) ** 2 / 2000).sum().item()
    assert chi2 < 99 + 5 * math.sqrt(2 * 99)
    assert torch.equal(counter_uniforms(seeds, torch.tensor([7])), u)  # a tensor step draws the same
    assert torch.equal(counter_uniforms(seeds[5:9], 7), u[5:9])  # a row's draw ignores the other rows
    lag = torch.corrcoef(torch.stack([u, counter_uniforms(seeds, 8)]))[0, 1].abs()
    assert lag < 0.01  # step s and s + 1 of the same rows are unrelated


def test_every_bit_of_a_seed_counts():
    """torch.Generator.manual_seed keeps a seed's low 32 bits, so seeds PURPOSE_STRIDE (2**40) apart drew the same
    numbers (issue 33): the eval, gate and train step-0 rows of one rollout.seed sampled alike."""
    base = torch.tensor([3, 3 + 2**32, 3 + 2**40, 3 + 2 * 2**40, 2**63 - 1])
    u = counter_uniforms(base, 0)
    assert len(set(u.tolist())) == 5
    purposes = [row_seeds(sampling_seed(0, p, 0), 64) for p in ("train", "eval", "gate")]
    draws = [counter_uniforms(torch.tensor(s), 0) for s in purposes]
    for a in range(3):
        for b in range(a + 1, 3):
            assert (draws[a] != draws[b]).float().mean() > 0.99
    g = [torch.Generator().manual_seed(s) for s in (5, 5 + PURPOSE_STRIDE)]
    assert torch.rand(1, generator=g[0]) == torch.rand(1, generator=g[1])  # what the generators did


def one_level(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("segment", [16, 4096])
def test_two_level_inverse_cdf_picks_the_one_level_token(monkeypatch, segment):
    """Segments of 16 over 1,000 columns: 63 of them, the last one short; 4,096: one segment (the CPU default)."""
    monkeypatch.setattr(sampling, "SAMPLE_SEGMENT", segment)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 1000, generator=g) * 3
    logits[:, 700:] = float("-inf")  # whole segments of probability 0 after the last real token
    u = torch.rand(4000, generator=g)
    tokens, total = sampling._two_level_inverse_cdf(logits, u)
    want = one_level(logits, u)
    assert (tokens == want).float().mean() > 0.999  # float sums in another order may move a boundary draw
    assert (tokens < 700).all()  # never a column of probability 0
    assert torch.allclose(total, torch.logsumexp(logits, -1), atol=1e-5)


def test_sampled_frequencies_follow_the_distribution(monkeypatch):
    monkeypatch.setattr(sampling, "SAMPLE_SEGMENT", 8)
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0, float("-inf"), 0.5, -3.0, 1.5, 0.2, -0.5, 1.0, float("-inf")]])
    rows = 60_000
    params = SamplingParams(n=1, max_new_tokens=1)
    tokens, logprobs = sample_next(logits.expand(rows, -1), params, torch.arange(rows), 3)
    p = torch.softmax(logits[0], -1)
    freq = torch.bincount(tokens, minlength=12).double() / rows
    assert freq[4] == 0 and freq[11] == 0
    assert (freq - p).abs().max() < 4 * math.sqrt(0.25 / rows)
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[0][tokens], atol=1e-6)


def test_temperature_and_greedy_report_the_raw_logprob():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(300, 50, generator=g)
    raw = torch.log_softmax(logits, -1)
    seeds = torch.arange(300)
    greedy, lp = sample_next(logits, SamplingParams(n=1, max_new_tokens=1, temperature=0.0), seeds, 0)
    assert torch.equal(greedy, logits.argmax(-1)) and torch.allclose(lp, raw.gather(-1, greedy[:, None])[:, 0])
    hot, lp = sample_next(logits, SamplingParams(n=1, max_new_tokens=1, temperature=1.7), seeds, 0)
    assert torch.allclose(lp, raw.gather(-1, hot[:, None])[:, 0], atol=1e-6)  # temperature-1 log-prob
    want = one_level(logits / 1.7, counter_uniforms(seeds, 0))
    assert (hot == want).float().mean() > 0.99
