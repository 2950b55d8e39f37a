"""The per-step proof on the path that samples: is what the rollout sampled what the learner computes?

Two tests, both before optimizer.step() (the learner's `_check_sampler_gap` gathers the sums over ranks, `judge_step`
decides): the sampler's log-probs against the learner's, bounded by what the conformance gate measured
(objectives/ratios.py `StepGapBound`), and the version test below, which asks which policy they sit nearer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from miniverl.errors import PolicyMismatchError
from miniverl.objectives.ratios import STEP_SPREAD_Z, StepGapBound

# Which version sampled? Every step, some of its rows (version_test_rows) are recomputed under older policies
# (VERSION_TESTS: the version before the batch's, the base model). A row votes (a - b) / (a + b) in [-1, 1], with a
# and b its sum of squared gaps between the sampler's log-probs and the learner's under the batch's version (a) and
# under the older policy (b): an honest sampler sits at the version it names (votes near -1 where the policies
# differ by more than the noise, around 0 where they do not), one that kept the older policy sits nearer it (near
# +1). The comparison shares the sampler's rounding, so it sees changes far smaller than the per-step |gap| bound can
# (that bound must cover bf16's noise). A step is refused when its mean vote is above 0 by STEP_SPREAD_Z standard
# errors (over its rows); steps with fewer than VERSION_TEST_MIN_ROWS rows are not voted on.
VERSION_TEST_ROWS = 32  # at most; as few as VERSION_TEST_MIN_ROWS once they hold VERSION_TEST_TOKENS sampled tokens
VERSION_TEST_MIN_ROWS = 16
VERSION_TEST_TOKENS = 4096
# The older policies each step is voted against (name -> how an error names it, given the previous version): the
# previous version (a sampler one refresh behind) and the base model, v0 (one that never took an adapter, or kept
# the first it served: a graph captured once, an engine copy never refreshed).
VERSION_TESTS = {"previous": "v{}", "base": "base model (v0, the adapter off)"}
# What the test can see on a step. A row's vote flips sign when its sampler swaps which of the two policies it sits
# at (the same rounding in its log-probs), so a sampler that had kept the older policy votes about the mirror image
# of an honest one: an honest z below -STEP_SPREAD_Z means that sampler would have been refused this step (the
# comparison is *armed*, logged as sampler_vs_<name>_armed). Near 0, the two policies differ by less than the
# sampler's rounding over the voted tokens, and a sampler at the older one would pass too, its samples no further
# from on-policy ones than that rounding. Small learning rates in bf16 do this to the one-behind comparison: after
# UNARMED_WARN_STEPS voted steps in a row of it, the run says so once (VersionTestWatch).
UNARMED_WARN_STEPS = 20


class SamplerGapError(PolicyMismatchError):
    """A step's sampled tokens sit further from the learner's log-probs than the run's bound, or nearer an older
    policy than the version the batch is stamped with."""


def version_test_rows(row_tokens: list[int]) -> list[int]:
    """The rows the version test recomputes, spread evenly over the batch (every uid group stays contiguous): enough
    to hold VERSION_TEST_TOKENS sampled tokens, between VERSION_TEST_MIN_ROWS and VERSION_TEST_ROWS (all rows of a
    smaller batch). `row_tokens`: each row's sampled tokens."""
    rows = len(row_tokens)
    mean = max(sum(row_tokens) / max(rows, 1), 1.0)
    count = min(rows, max(VERSION_TEST_MIN_ROWS, min(VERSION_TEST_ROWS, math.ceil(VERSION_TEST_TOKENS / mean))))
    return sorted({i * rows // count for i in range(count)}) if count else []


def version_votes(
    sampler: torch.Tensor, learner: torch.Tensor, older: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Each row's vote for 'the sampler used the older policy': (a - b) / (a + b), with a and b the row's sums of
    squared gaps between the sampler's log-probs and the learner's under the batch's version (a) and under the older
    policy (b); 0 where both are 0. Shapes: [B, T] x 4 -> [B] float64."""
    m = mask.to(torch.float64)
    s, cur, old = (x.detach().double() for x in (sampler, learner, older))
    a, b = (((s - cur) ** 2) * m).sum(-1), (((s - old) ** 2) * m).sum(-1)  # [B]
    total = a + b
    return torch.where(total > 0, (a - b) / total.clamp_min(1e-300), torch.zeros_like(total))


def vote_sums(votes: torch.Tensor, tokens: int) -> list[float]:
    """[sum of votes, sum of their squares, rows, tokens]: what `vote_z` needs, adding across ranks."""
    return [float(votes.sum()), float((votes * votes).sum()), float(votes.numel()), float(tokens)]


def vote_z(sums: list[float]) -> tuple[float, float]:
    """(mean vote, its z: mean / standard error over rows) from `vote_sums`; z 0 with fewer than 2 rows or no
    spread (where every row votes alike, the mean alone decides: +-inf)."""
    total, squares, rows, _ = sums
    if rows < 2:
        return 0.0, 0.0
    mean = total / rows
    variance = max(squares - rows * mean * mean, 0.0) / (rows - 1)
    if variance == 0:
        return mean, 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean, mean / math.sqrt(variance / rows)


def judge_step(
    bound: StepGapBound,
    gap_abs: float,
    gap_max: float,
    gap_tail: int,
    votes: list[float],
    num_tokens: int,
    version: int,
    learner_version: int,
) -> dict[str, float]:
    """The per-step decision on the whole step's sums (every rank's added): raise SamplerGapError when the sampler's
    log-probs sit nearer an older policy than the batch's `version` (the version test, `votes`: VERSION_TESTS' order,
    4 sums each), are not finite, or sit further from the learner's than `bound` allows (mean |gap| from `gap_abs`,
    the share of tokens beyond its tail from `gap_tail`). Returns the version test's metrics: each comparison's z
    and the tokens it recomputed."""
    version_metrics = {"sampler_version_tokens": max(votes[3::4])}
    for i, (name, older) in enumerate(VERSION_TESTS.items()):
        sums = votes[4 * i : 4 * i + 4]
        vote, z = vote_z(sums)
        voted = sums[2] >= VERSION_TEST_MIN_ROWS
        version_metrics[f"sampler_vs_{name}_z"] = max(min(z, 1e6), -1e6)  # finite in the metrics
        version_metrics[f"sampler_vs_{name}_armed"] = float(voted and z < -STEP_SPREAD_Z)
        if voted and vote > 0 and z > STEP_SPREAD_Z:
            raise SamplerGapError(
                f"the sampler's log-probs of {sums[3]:.0f} of this step's tokens ({sums[2]:.0f} rows) sit nearer"
                f" the learner's {older.format(version - 1)} than the v{version} the batch is stamped with (mean"
                f" row vote {vote:.2f} of [-1, 1], {z:.1f} standard errors above 0; refused beyond {STEP_SPREAD_Z:g});"
                " the update was not applied. The rollout side sampled an older policy than it was proven to serve:"
                " a generation path that kept it (a stale cache, graph or engine copy) while its adapter buffers are"
                " current"
            )
    mean, tail_share = gap_abs / max(num_tokens, 1), gap_tail / max(num_tokens, 1)
    mean_bound, share_bound = bound.mean_at(num_tokens), bound.tail_share_at(num_tokens)
    if not math.isfinite(mean) or not math.isfinite(gap_max):  # `mean > bound` is False for NaN
        raise SamplerGapError(
            f"the sampler's log-probs of this step's {num_tokens} tokens are not finite against the learner's"
            f" v{learner_version} (mean gap {mean}, max {gap_max}); the update was not applied. The rollout side"
            " returned NaN or infinite log-probs: check its model, dtype and sampling settings"
        )
    if mean <= mean_bound and tail_share <= share_bound:
        return version_metrics
    which = (
        "the per-step bound calibrated at the conformance gate from this backend's honest gap"
        if bound.source == "gate"
        else "the objective's per-step bound"
    )
    raise SamplerGapError(
        f"the sampler's log-probs of this step's {num_tokens} tokens sit mean {mean:.3g} nats (max {gap_max:.3g};"
        f" {tail_share:.1%} of tokens beyond {bound.tail:.3g}) from the learner's v{learner_version}, above {which}"
        f" (mean {mean_bound:.3g}, at most {share_bound:.1%} of tokens beyond {bound.tail:.3g}); the update"
        " was not applied. The rollout side does not sample what the learner computes: a generation path that"
        " kept an older policy (a stale cache, graph or engine copy) while its adapter buffers are current, or"
        " another model, dtype or quantization than the learner's"
    )


class VersionTestWatch:
    """A run's record of what its version test could see: over the steps it voted on, how many each comparison was
    armed on (UNARMED_WARN_STEPS' comment), and one line, the first time the one-behind comparison has been unarmed
    UNARMED_WARN_STEPS voted steps in a row, saying what that leaves unproven."""

    def __init__(self) -> None:
        self.voted = 0
        self.armed = dict.fromkeys(VERSION_TESTS, 0)
        self._unarmed_run = 0
        self._warned = False

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """A step's learner metrics (sampler_check's keys; a step without them, or not voted on, counts nothing);
        returns the warning line once, else None."""
        if not metrics.get("sampler_version_tokens"):
            return None
        self.voted += 1
        for name in VERSION_TESTS:
            self.armed[name] += int(metrics.get(f"sampler_vs_{name}_armed", 0.0) > 0)
        self._unarmed_run = 0 if metrics.get("sampler_vs_previous_armed", 0.0) > 0 else self._unarmed_run + 1
        if self._warned or self._unarmed_run < UNARMED_WARN_STEPS:
            return None
        self._warned = True
        return (
            f"[miniverl] sync, step {step}: for {UNARMED_WARN_STEPS} voted steps in a row the version test could not"
            f" tell the policy from the one a refresh before (honest votes above -{STEP_SPREAD_Z:g} standard errors"
            f" over {metrics['sampler_version_tokens']:.0f} tokens; last z {metrics['sampler_vs_previous_z']:.1f}):"
            " each update moves it less than the sampler's rounding, so a sampler one refresh behind would pass"
            " this test, its samples no further from on-policy ones than that rounding. The adapter digest, the"
            " per-step |gap| bound and the base-model comparison still hold (a sampler stuck further back is"
            " refused once the policy has moved past the rounding: armed on"
            f" {self.armed['base']} of {self.voted} voted steps so far). sampler_vs_*_armed in metrics.jsonl"
            " tracks both"
        )

    def summary(self) -> dict[str, Any]:
        """For summary.json: the voted steps and, per comparison, the steps it was armed on."""
        return {"voted_steps": self.voted, "armed_steps": dict(self.armed)}
