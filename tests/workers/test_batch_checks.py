"""The learner's checks of a batch (workers/batch_checks.py) on hand-made numbers: the lag it may train at, the
lag metrics, the sampler-gap and version-test sums, and their total over ranks."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.errors import PolicyMismatchError
from miniverl.objectives.sampler_check import version_votes, vote_sums
from miniverl.policy import PolicyIdentity
from miniverl.workers.batch_checks import (
    StaleBatchError,
    check_lag,
    gap_sums,
    lag_metrics,
    sum_over_ranks,
    version_test_sums,
)

AT_V3 = PolicyIdentity(3, "ab" * 32)


def test_a_batch_within_the_lag_of_a_kept_version_is_accepted():
    assert check_lag(3, AT_V3, 3, 0, {}) == 0  # strict sync: the version just published, nothing kept
    assert check_lag(3, AT_V3, 2, 1, {2: {}, 3: {}}) == 1


@pytest.mark.parametrize(
    ("published", "batch_version", "staleness", "kept", "why"),
    [
        (None, 3, 0, {}, "trains only on rollouts of the policy it just published"),
        (PolicyIdentity(2, "cd" * 32), 3, 0, {}, "trains only on rollouts of the policy it just published"),
        (AT_V3, 4, 1, {4: {}}, "has not reached"),
        (AT_V3, 1, 1, {1: {}}, "its lag of 2 versions exceeds trainer.staleness=1"),
        (AT_V3, 2, 1, {}, "never published v2 in this process"),
    ],
)
def test_any_other_batch_is_refused_with_the_reason(published, batch_version, staleness, kept, why):
    said = f"published: {published.short() if published else 'nothing'}"
    with pytest.raises(
        StaleBatchError, match=f"at policy v3 \\({said}\\) .*sampled by v{batch_version}: .*{why}"
    ) as raised:
        check_lag(3, published, batch_version, staleness, kept)
    assert isinstance(raised.value, PolicyMismatchError)
    assert (raised.value.lag, raised.value.staleness) == (3 - batch_version, staleness)


def test_lag_metrics_are_the_drift_and_the_largest_ratio_and_absent_in_strict_sync():
    delta = torch.tensor([0.5, -1.0, 0.25])
    assert lag_metrics(delta, 5, 0) == {}
    assert lag_metrics(delta, 5, 1) == pytest.approx(
        {"policy_drift_mean": 1.75 / 5, "policy_drift_max": 1.0, "ratio_max": math.exp(0.5)}
    )
    assert lag_metrics(torch.zeros(0), 0, 1) == {"policy_drift_mean": 0.0, "policy_drift_max": 0.0, "ratio_max": 1.0}


def test_gap_sums_are_the_total_the_largest_and_the_tokens_beyond_the_tail():
    assert gap_sums(torch.tensor([0.1, 0.5, 0.25, 0.5]), 0.3) == pytest.approx((1.35, 0.5, 2))
    assert gap_sums(torch.zeros(0), 0.3) == (0.0, 0.0, 0)  # a rank without tokens


def test_version_test_sums_vote_each_older_policy_in_order_and_zero_one_not_held():
    g = torch.Generator().manual_seed(0)
    sampler, recomputed, older = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = torch.ones(3, 5)
    mask[0, 3:] = 0
    voted = vote_sums(version_votes(sampler, recomputed, older, mask), 13)
    assert version_test_sums(sampler, recomputed, mask, (None, older)) == [0.0] * 4 + voted
    # a sampler that kept the older policy: every row votes +1 for it
    assert version_test_sums(older, recomputed, mask, (older,)) == [3.0, 3.0, 3.0, 13.0]


def test_sums_over_one_rank_come_back_as_they_went(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        assert sum_over_ranks(1.5, 0.75, 3, [1.0, 2.0], "cpu") == (1.5, 0.75, 3, [1.0, 2.0])
    finally:
        dist.destroy_process_group()


def test_sums_over_ranks_need_the_process_group():
    with pytest.raises(ValueError, match="process group"):
        sum_over_ranks(1.5, 0.75, 3, [], "cpu")
