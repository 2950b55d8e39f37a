"""The preregistered rules that invalidate a cell. Each returns the reasons it found (empty: the cell passes).

A rule never drops a cell or zeroes its numbers: the report shows an invalid cell with what was measured
and why it does not count.
"""

from __future__ import annotations

import statistics

import torch

from lab.bench.config import InvalidationRules

TIME_CAP = "time cap"
OUT_OF_MEMORY = "out of memory"


def short_rows(lengths: list[int], asked: int) -> list[str]:
    """Every row must generate exactly `asked` tokens (the bench passes no stop tokens)."""
    short = [n for n in lengths if n < asked]
    if not short:
        return []
    return [f"fewer tokens than asked: {len(short)} of {len(lengths)} rows short (shortest {min(short)} of {asked})"]


def spread(tokens_per_s: list[float], spread_max: float) -> tuple[float | None, list[str]]:
    """(max - min) / median over the timed repeats; None (not checked) with fewer than two repeats."""
    if len(tokens_per_s) < 2:
        return None, []
    s = (max(tokens_per_s) - min(tokens_per_s)) / statistics.median(tokens_per_s)
    return s, ([f"spread across repeats {s:.1%} > {spread_max:.0%}"] if s > spread_max else [])


def logprob_gap(gaps: torch.Tensor, rules: InvalidationRules) -> tuple[dict[str, float], list[str]]:
    """Judge |backend log-prob - oracle log-prob| of every sampled token.

    Shapes: gaps [tokens] float32 (all rows of the cell, flattened).
    """
    if gaps.numel() == 0:
        return {}, ["no generated tokens to compare with the oracle"]
    if not bool(torch.isfinite(gaps).all()):
        return {}, ["log-probs differ from the oracle: non-finite values"]
    stats = {
        "gap_mean": gaps.mean().item(),
        "gap_p99": torch.quantile(gaps.double(), 0.99).item(),
        "gap_max": gaps.max().item(),
        "outlier_frac": (gaps > rules.logprob_gap_outlier).float().mean().item(),
    }
    reasons = []
    if stats["gap_mean"] > rules.logprob_gap_mean_max:
        reasons.append(
            f"log-probs differ from the oracle: mean gap {stats['gap_mean']:.3g} > {rules.logprob_gap_mean_max:g}"
        )
    if stats["outlier_frac"] > rules.logprob_gap_outlier_frac_max:
        reasons.append(
            f"log-probs differ from the oracle: {stats['outlier_frac']:.2%} of tokens off by more than"
            f" {rules.logprob_gap_outlier:g} (max {rules.logprob_gap_outlier_frac_max:.2%})"
        )
    return stats, reasons
