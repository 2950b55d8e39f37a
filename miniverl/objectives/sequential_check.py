"""Evidence that accumulates: sequential tests over the run's steps, beside the per-step sampler check.

The per-step tests (objectives/sampler_check.py judge_step) judge each step alone: a sampler whose gap drifts up
slowly passes every step until one crosses the bound (a stale generation path in bf16 at lr 2e-4 with 8 rows was
stopped only at step 7, its mean gap rising from 0.0045 to 0.0355 against a bound of 0.0323: issue 76), and the
version test does not vote below VERSION_TEST_MIN_ROWS rows. Here each step gives a statistic that is at most
standard in control, and a one-sided CUSUM of each,

    S_t = max(0, S_{t-1} + z_t - CUSUM_ALLOWANCE),

stops the run (SamplerGapError, as the per-step tests) once S_t > CUSUM_THRESHOLD, before that step's update:
- the gap: z = (step mean |gap| - the gate's honest mean) / (the gate's per-token spread / sqrt(N)), the spread
  the per-step bound uses (max of the gate's std and p99: StepGapBound.spread / STEP_SPREAD_Z), never below
  STEP_MEAN_FLOOR / STEP_SPREAD_Z (fp32's rounding, as the bound's floor). Armed once the gate has calibrated.
- each version comparison (VERSION_TESTS: the previous version, the base model): z = the step's sum of row votes /
  the root of their sum of squares (self-normalized). An honest sampler's votes sit around 0 where the policies do
  not differ and below it where they do (sampler_check.py); for votes symmetric about 0 this z is a Rademacher sum
  with unit-norm weights, so sub-Gaussian with variance proxy 1 at any number of rows and any vote scale (Hoeffding):
  it needs no sample variance, so it counts at 2 rows as at 32. Rows that agree on a positive vote give z = sqrt(rows).

The false-alarm bound: for increments of mean <= 0 that are sub-Gaussian with variance proxy 1, a CUSUM with
allowance k and threshold h runs on average at least exp(2kh) steps before a false alarm (the moment-generating
function's root is at least 2k; in_control_run_length). With allowance 1, threshold 5.2 is the smallest tenth for
which any of the three tests false-alarms no sooner than every 10,000 steps on average: >= 32,860 steps each, >=
10,953 for any (standard-normal steps: about 170,000 each, Siegmund's approximation). Measured honest steps sit well
inside that null (lab/results/sampler-gap/cusum-cpu.md). A sampler at the older policy whose 8 rows all vote alike
gives z = 2.8 a step, over the threshold at the third stale step; a gap drifting up by one spread unit a step crosses
at the fourth (the per-step bound, six units and twice the honest mean up, not before the seventh).

The statistics start from 0 at the gate and are not in checkpoints: the evidence is about this run's serving
processes, and a resumed run starts new ones and runs its gate again (whose calibration sets the gap z's unit).
"""

from __future__ import annotations

import math
from collections import deque

from miniverl.objectives.ratios import STEP_MEAN_FLOOR, STEP_SPREAD_Z, StepGapBound
from miniverl.objectives.sampler_check import VERSION_TESTS, SamplerGapError

CUSUM_ALLOWANCE = 1.0  # k: half the shift (in z) detected fastest; evidence below it drains away
CUSUM_THRESHOLD = 5.2  # h: in-control average run length >= exp(2kh) = 32,860 steps a test (module docstring)
RECENT_STEPS = 4  # the z of the last this many steps, quoted when a test refuses
# The fix every sequential refusal names: what a sampler drifting from the learner is (as judge_step's errors).
STALE_PATH = (
    "a generation path that kept an older policy (a stale cache, graph or engine copy) while its adapter buffers are"
    " current"
)


def in_control_run_length(allowance: float, threshold: float) -> float:
    """The lower bound on a one-sided CUSUM's average run length in control, exp(2 k h), for increments of mean <= 0
    that are sub-Gaussian with variance proxy 1 (so also for standard-normal ones)."""
    return math.exp(2 * allowance * threshold)


def gap_z(mean_gap: float, tokens: int, bound: StepGapBound, honest_mean: float) -> float:
    """A step's mean |gap| (nats) over its `tokens` in standard errors of the gate's per-token spread above the
    gate's `honest_mean` (the module docstring)."""
    unit = max(bound.spread / STEP_SPREAD_Z / math.sqrt(max(tokens, 1)), STEP_MEAN_FLOOR / STEP_SPREAD_Z)
    return (mean_gap - honest_mean) / unit


def vote_step_z(sums: list[float]) -> float | None:
    """A version comparison's step statistic from its vote_sums (sum, squares, rows, tokens): sum / sqrt(squares);
    None where no row voted, or every vote was 0 (policies that do not differ at all: no evidence)."""
    total, squares, _, _ = sums
    return total / math.sqrt(squares) if squares > 0 else None


class Cusum:
    """One one-sided CUSUM: its statistic and the last steps' z."""

    def __init__(self) -> None:
        self.statistic = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)

    def add(self, z: float) -> bool:
        """Add a step's z; True once the statistic is over CUSUM_THRESHOLD."""
        self.statistic = max(0.0, self.statistic + z - CUSUM_ALLOWANCE)
        self.recent.append(z)
        return self.statistic > CUSUM_THRESHOLD

    def said(self) -> str:
        recent = ", ".join(f"{x:.1f}" for x in self.recent)
        return (
            f"reached {self.statistic:.1f}, above {CUSUM_THRESHOLD:g} (z of the last steps: {recent}; allowance"
            f" {CUSUM_ALLOWANCE:g} a step)"
        )


class SequentialSamplerTests:
    """The run's CUSUMs of the sampler check (module docstring): one of the gap, armed by the gate's honest mean
    (`calibrate`), and one per version comparison."""

    def __init__(self) -> None:
        self.honest_mean: float | None = None
        self.gap = Cusum()
        self.versions = {name: Cusum() for name in VERSION_TESTS}

    def calibrate(self, honest_mean: float) -> None:
        """Arm the gap's test on the gate's honest mean |gap| (nats); every statistic starts from 0."""
        self.honest_mean = honest_mean
        self.gap = Cusum()
        self.versions = {name: Cusum() for name in VERSION_TESTS}

    def observe(
        self,
        gap_abs: float,
        num_tokens: int,
        bound: StepGapBound,
        votes: list[float],
        version: int,
        learner_version: int,
    ) -> dict[str, float]:
        """Add a step that passed the per-step tests (its summed |gap| `gap_abs` over `num_tokens` tokens and its
        version `votes`, every rank's; `bound` the per-step bound; `version` the batch's) to the evidence; raise
        SamplerGapError when a statistic crosses CUSUM_THRESHOLD. Returns each step z and statistic (0 where not
        observed)."""
        out = {"sampler_gap_z": 0.0, "sampler_gap_cusum": 0.0}
        if self.honest_mean is not None and num_tokens > 0:
            mean = gap_abs / num_tokens
            z = gap_z(mean, num_tokens, bound, self.honest_mean)
            if self.gap.add(z):
                raise SamplerGapError(
                    f"the sampler's log-probs have sat above the honest gap step after step: the run's CUSUM of each"
                    f" step's mean |gap| (in standard errors above the gate's honest mean {self.honest_mean:.3g}"
                    f" nats; this step {mean:.3g} over {num_tokens} tokens against the learner's v{learner_version})"
                    f" {self.gap.said()}; the update was not applied. The rollout side drifts away from what the"
                    f" learner computes: {STALE_PATH}"
                )
            out.update(sampler_gap_z=max(min(z, 1e6), -1e6), sampler_gap_cusum=self.gap.statistic)
        for i, (name, older) in enumerate(VERSION_TESTS.items()):
            sums = votes[4 * i : 4 * i + 4]
            z = vote_step_z(sums)
            test = self.versions[name]
            if z is not None and test.add(z):
                raise SamplerGapError(
                    f"the sampler's log-probs have sat nearer the learner's {older.format(version - 1)} than the"
                    f" version each batch is stamped with, step after step: the run's CUSUM of each step's row votes"
                    f" (their sum / the root of their squares; this step {sums[2]:.0f} rows, {sums[3]:.0f} tokens,"
                    f" stamped v{version})"
                    f" {test.said()}; the update was not applied. The rollout side sampled an older policy than it"
                    f" was proven to serve: {STALE_PATH}"
                )
            out[f"sampler_vs_{name}_cusum"] = test.statistic
        return out
