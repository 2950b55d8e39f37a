"""The sequential sampler tests (objectives/sequential_check.py): one-sided CUSUMs of the per-step gap, in the gate's
own units, and of the version votes; a slow drift each step passes is stopped, honest statistics never are."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.ratios import STEP_MEAN_FLOOR, STEP_SPREAD_Z
from miniverl.objectives.sampler_check import VERSION_TESTS, SamplerGapError, judge_step, vote_sums
from miniverl.objectives.sequential_check import (
    CUSUM_ALLOWANCE,
    CUSUM_THRESHOLD,
    Cusum,
    SequentialSamplerTests,
    gap_z,
    in_control_run_length,
    vote_step_z,
)

GKD = GkdObjective(0.5, 1.0, 0)
# A bf16 gate of the built-in models on hf_cached (lab/results/sampler-gap/cpu-bf16-honest1000-version.json): its
# honest mean, p99 and per-token std of |gap|, nats.
GATE = (0.0088, 0.0527, 0.0116)
TOKENS = 64  # a step of 8 rows of about 8 tokens
NO_VOTES = [0.0] * 4 * len(VERSION_TESTS)


def bound():
    return GKD.sampler_tolerance.step_bound(*GATE)


def armed() -> SequentialSamplerTests:
    tests = SequentialSamplerTests()
    tests.calibrate(GATE[0])
    return tests


def test_the_threshold_bounds_false_alarms_of_all_three_tests_together():
    # Any of the gap's and the two version comparisons' tests: on average no sooner than 10,000 honest steps
    assert in_control_run_length(CUSUM_ALLOWANCE, CUSUM_THRESHOLD) / (1 + len(VERSION_TESTS)) >= 10_000


def test_standard_normal_steps_run_at_least_the_bound_before_a_false_alarm():
    """The bound by simulation: 2,000 CUSUMs of standard-normal z (a null wider than honest steps measured), each
    10,000 steps; the share that alarmed within them is no more than an average run length >= 32,860 allows."""
    gen = torch.Generator().manual_seed(0)
    runs, steps = 2_000, 10_000
    s = torch.zeros(runs, dtype=torch.float64)
    alarmed = torch.zeros(runs, dtype=torch.bool)
    for _ in range(steps):
        s = (s + torch.randn(runs, generator=gen, dtype=torch.float64) - CUSUM_ALLOWANCE).clamp_min(0)
        alarmed |= s > CUSUM_THRESHOLD
    # geometric in-control run lengths of mean >= 32,860: P(alarm within 10,000) <= 1 - exp(-10,000 / 32,860) = 0.26
    assert alarmed.float().mean() <= 1 - math.exp(-steps / in_control_run_length(CUSUM_ALLOWANCE, CUSUM_THRESHOLD))


def test_the_gap_z_is_in_the_gates_own_spread_units_with_the_bounds_floor():
    b = bound()
    unit = max(GATE[1], GATE[2]) / math.sqrt(TOKENS)  # the p99, the larger, as the per-step bound's spread
    assert gap_z(GATE[0] + 2 * unit, TOKENS, b, GATE[0]) == pytest.approx(2.0)
    assert gap_z(GATE[0], TOKENS, b, GATE[0]) == 0.0
    fp32 = GKD.sampler_tolerance.step_bound(4e-7, 3e-6, 1e-7)  # rounding alone: the floor is the unit
    assert gap_z(4e-7 + STEP_MEAN_FLOOR, 10**6, fp32, 4e-7) == pytest.approx(STEP_SPREAD_Z)


def test_vote_z_is_self_normalized_and_counts_at_a_few_rows():
    alike = torch.full((8,), 0.3)  # 8 rows all a little nearer the older policy
    assert vote_step_z(vote_sums(alike, 64)) == pytest.approx(math.sqrt(8))
    assert vote_step_z(vote_sums(torch.tensor([0.5, -0.5]), 10)) == 0.0
    assert vote_step_z(vote_sums(torch.zeros(8), 64)) is None and vote_step_z([0.0] * 4) is None


def test_a_slowly_drifting_gap_each_step_passes_is_stopped_within_a_few_steps():
    """A stale sampler's mean gap rising by one spread unit a step: the per-step bound passes all seven steps (it sits
    six units up, plus twice the honest mean), the CUSUM stops the fourth, before its update."""
    tests, b = armed(), bound()
    unit = max(GATE[1], GATE[2]) / math.sqrt(TOKENS)
    caught = None
    for step in range(1, 8):
        mean = GATE[0] + step * unit
        try:
            judge_step(b, mean * TOKENS, mean, 0, NO_VOTES, TOKENS, step, step)  # the per-step tests pass it
        except SamplerGapError:
            pytest.fail(f"the per-step bound stopped step {step}: the drift is not below it")
        try:
            tests.observe(mean * TOKENS, TOKENS, b, NO_VOTES, step, step)
        except SamplerGapError as e:
            caught = step
            assert "CUSUM of each step's mean |gap|" in str(e) and "the update was not applied" in str(e)
            break
    assert caught == 4


def test_a_sampler_at_the_older_policy_is_stopped_by_its_votes_below_the_version_tests_rows():
    """8 rows (the per-step version test votes from 16) all a little nearer the base model: stopped at the third."""
    tests, b = armed(), bound()
    stale = vote_sums(torch.full((8,), 0.2), TOKENS)
    honest = vote_sums(-torch.full((8,), 0.2), TOKENS)
    for step in range(1, 4):
        votes = honest + stale  # VERSION_TESTS' order: the previous version (honest here), the base model
        if step < 3:
            metrics = tests.observe(GATE[0] * TOKENS, TOKENS, b, votes, step, step)
            assert metrics["sampler_vs_base_cusum"] == pytest.approx(step * (math.sqrt(8) - CUSUM_ALLOWANCE))
            assert metrics["sampler_vs_previous_cusum"] == 0.0
        else:
            with pytest.raises(SamplerGapError, match=r"nearer the learner's base model .* CUSUM of each step's row"):
                tests.observe(GATE[0] * TOKENS, TOKENS, b, votes, step, step)


def test_honest_steps_from_the_calibrated_null_never_alarm_over_1000_steps():
    """1,000 steps whose tokens' gaps are drawn from the gate's own honest distribution (a half-normal scaled to its
    mean, with a p99-sized token in one step of four), and whose 8 rows' votes are symmetric about 0 (policies that
    do not differ: the version test's hardest null): no alarm, and the statistics stay far below the threshold."""
    gen = torch.Generator().manual_seed(1)
    tests, b = armed(), bound()
    peak = dict.fromkeys(("sampler_gap_cusum", "sampler_vs_previous_cusum", "sampler_vs_base_cusum"), 0.0)
    for step in range(1, 1001):
        gaps = torch.randn(TOKENS, generator=gen).abs() * GATE[0] * math.sqrt(math.pi / 2)
        if step % 4 == 0:
            gaps[0] = GATE[1]
        votes = [x for _ in VERSION_TESTS for x in vote_sums(torch.rand(8, generator=gen) * 2 - 1, TOKENS)]
        metrics = tests.observe(float(gaps.sum()), TOKENS, b, votes, step, step)
        peak = {k: max(v, metrics[k]) for k, v in peak.items()}
    assert max(peak.values()) < CUSUM_THRESHOLD, peak


def test_the_statistic_drains_below_the_allowance_and_starts_again_at_calibration():
    c = Cusum()
    assert not c.add(3.0) and c.statistic == 2.0
    assert not c.add(0.0) and c.statistic == 1.0 and not c.add(-5.0) and c.statistic == 0.0
    tests = armed()
    tests.gap.add(5.0)
    tests.calibrate(GATE[0])
    assert tests.gap.statistic == 0.0
    unarmed = SequentialSamplerTests()  # before the gate: the gap is not observed (no honest mean)
    assert unarmed.observe(1.0 * TOKENS, TOKENS, bound(), NO_VOTES, 1, 1)["sampler_gap_cusum"] == 0.0
