"""What the learner checks of a batch before its optimizer step, on plain values and tensors.

Owns the batch's lag (`check_lag`: refused with StaleBatchError unless this learner published the version that
sampled it, at most trainer.staleness versions back) and the per-step sums the sampler-gap check judges: the gap
(`gap_sums`), the version test's (`version_test_sums`) and their total over data-parallel ranks (`sum_over_ranks`);
objectives/sampler_check.py `judge_step` decides on them. `lag_metrics` reports how far a lagging step's policy
sits from its sampler. The learner (workers/learner.py) computes the log-probs under each policy and calls these,
the sampler-gap check (workers/sampler_gap.py) the version test's sums.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import torch

from miniverl.errors import PolicyMismatchError
from miniverl.objectives.sampler_check import version_votes, vote_sums
from miniverl.policy import PolicyIdentity


class StaleBatchError(PolicyMismatchError):
    """A batch sampled by a policy more versions behind the learner than trainer.staleness allows (or ahead
    of it, or by a version this learner never published)."""

    def __init__(self, message: str, batch_version: int, learner_version: int, staleness: int) -> None:
        super().__init__(message)
        self.batch_version, self.learner_version, self.staleness = batch_version, learner_version, staleness

    @property
    def lag(self) -> int:
        return self.learner_version - self.batch_version


def check_lag(
    version: int, published: PolicyIdentity | None, batch_version: int, staleness: int, kept: Container[int]
) -> int:
    """The batch's lag (learner `version` - `batch_version`), refused unless 0 <= lag <= `staleness`, the batch's
    version is one whose adapter the learner `kept` since publishing it (lag 0 needs none), and the current policy
    was `published` (so the next rollout can be proven to come from it)."""
    lag = version - batch_version
    is_published = published is not None and published.version == version
    known = lag == 0 or batch_version in kept
    if is_published and 0 <= lag <= staleness and known:
        return lag
    if not is_published:
        why = "strict sync trains only on rollouts of the policy it just published"
    elif lag < 0:
        why = "the batch comes from a policy the learner has not reached"
    elif lag > staleness:
        why = f"its lag of {lag} versions exceeds trainer.staleness={staleness}"
    else:
        why = f"the learner never published v{batch_version} in this process (restored from a checkpoint?)"
    raise StaleBatchError(
        f"learner is at policy v{version} (published:"
        f" {published.short() if published else 'nothing'}) but the batch was sampled by"
        f" v{batch_version}: {why}; the update was not applied",
        batch_version,
        version,
        staleness,
    )


def lag_metrics(delta: torch.Tensor, num_tokens: int, staleness: int) -> dict[str, float]:
    """In a run that allows a lag (`staleness` > 0): how far the policy being updated sits from the sampler on the
    step's tokens (`delta` = log q_theta - log q_sampler; the sampler gap plus the policy's change since the version
    that sampled, equal to the sampler gap at lag 0), and the largest importance ratio (the objective logs ratio_mean
    and clipped_ratio_frac). Empty in strict sync (the controller logs the lag itself as `staleness`).
    Shapes: delta [n] (this rank's sampled tokens); `num_tokens`: the whole step's."""
    if not staleness:
        return {}
    drift = delta.abs()
    return {
        "policy_drift_mean": drift.sum().item() / max(num_tokens, 1),
        "policy_drift_max": drift.max().item() if delta.numel() else 0.0,
        "ratio_max": delta.max().exp().item() if delta.numel() else 1.0,
    }


def gap_sums(gap: torch.Tensor, tail: float) -> tuple[float, float, int]:
    """This rank's sums of the sampler gap for judge_step: the total and the largest gap (nats; 0 without tokens)
    and how many tokens sit beyond the bound's `tail`. Shapes: gap [n] (|log q_learner - log q_sampler| of this
    rank's sampled tokens)."""
    return gap.sum().item(), gap.max().item() if gap.numel() else 0.0, (gap > tail).sum().item()


def version_test_sums(
    sampler: torch.Tensor, recomputed: torch.Tensor, mask: torch.Tensor, olders: Sequence[torch.Tensor | None]
) -> list[float]:
    """The version test's sums (objectives/sampler_check.py vote_sums, 4 per comparison) of the rows it recomputed:
    the sampler's log-probs voted between the learner's under the batch's version (`recomputed`) and under each
    older policy (`olders`, VERSION_TESTS' order); zeros for an older policy that is None (not held, or one that
    cannot differ). Shapes: sampler, recomputed, mask and each older [R, Tr]."""
    sums, tokens = [], int(mask.sum())
    for older in olders:
        if older is None:
            sums += [0.0] * 4
        else:
            sums += vote_sums(version_votes(sampler, recomputed, older, mask), tokens)
    return sums


def sum_over_ranks(
    gap_abs: float, gap_max: float, gap_tail: int, votes: list[float], device: str
) -> tuple[float, float, int, list[float]]:
    """The whole step's sums from every data-parallel rank's (`gap_sums`, `version_test_sums`): totals added,
    the largest gap the largest of all; every rank gets the same. Needs the process group
    (LearnerWorker.init_distributed)."""
    import torch.distributed as dist

    total = torch.tensor([gap_abs, float(gap_tail), *votes], device=device, dtype=torch.float64)
    peak = torch.tensor([gap_max], device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    (gap_abs, gap_tail, *votes), gap_max = total.tolist(), float(peak)
    return gap_abs, gap_max, int(gap_tail), votes
