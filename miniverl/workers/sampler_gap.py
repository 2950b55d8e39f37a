"""The learner's side of the per-step sampler-gap check: its bound, the adapters it is measured under, the version test.

Every step's sampled tokens are held, before optimizer.step(), to `bound` (the objective's until the conformance
gate calibrates it: `calibrate`). The check scores a batch of version v under v's adapter, and some of its rows
under v - 1's and the base model's for the version test, so `behaviour` keeps the adapter of every version
published within the lag window and the one before it (docs/objectives.md). The learner (workers/learner.py)
computes the log-probs and sums a step over its data-parallel ranks (workers/batch_checks.py), and
objectives/sampler_check.py judge_step decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from miniverl.batches import RolloutBatch
from miniverl.objectives.ratios import SamplerTolerance
from miniverl.objectives.sampler_check import VERSION_TESTS, judge_step, version_test_rows
from miniverl.objectives.sequential_check import SequentialSamplerTests
from miniverl.workers.batch_checks import version_test_sums
from miniverl.workers.publisher import PolicyPublisher


class SamplerGapCheck:
    def __init__(self, tolerance: SamplerTolerance) -> None:
        """`tolerance`: the objective's (Objective.sampler_tolerance), the bound until the gate calibrates one."""
        self.tolerance = tolerance
        # what every step's sampler gap is held to: the objective's bound until the conformance gate calibrates it
        self.bound = tolerance.step_bound()
        # version -> adapter weights of every version published within the lag window and the one before it: a
        # batch of version v is scored under v's adapter for the sampler-gap check (docs/objectives.md), and some
        # of its rows under v - 1's for the version test (`version_votes`)
        self.behaviour: dict[int, dict[str, torch.Tensor]] = {}
        # the steps' evidence added up over the run (objectives/sequential_check.py): the gap's, armed by the gate
        self.sequential = SequentialSamplerTests()

    def calibrate(self, gate_mean: float, gate_p99: float, gate_std: float) -> dict[str, float | str]:
        """Hold every later step to the bound calibrated from the conformance gate's honest gap (mean, p99 and
        per-token std in nats, of this run's backend, dtype and model; objectives/ratios.py, step_bound). Returns
        the bound."""
        self.bound = self.tolerance.step_bound(gate_mean, gate_p99, gate_std)
        self.sequential.calibrate(gate_mean)
        return dataclasses.asdict(self.bound)

    def judge(
        self,
        gap_abs: float,
        gap_max: float,
        gap_tail: int,
        votes: list[float],
        num_tokens: int,
        version: int,
        learner_version: int,
    ) -> dict[str, float]:
        """A step's decision on its whole sums (every rank's): the per-step bound and the version test (judge_step),
        then the run's accumulated evidence (SequentialSamplerTests); SamplerGapError from either. Returns the
        version test's metrics and the sequential tests' step z and statistics."""
        metrics = judge_step(self.bound, gap_abs, gap_max, gap_tail, votes, num_tokens, version, learner_version)
        sequential = self.sequential.observe(gap_abs, num_tokens, self.bound, votes, version, learner_version)
        return {**metrics, **sequential}

    def keep(self, version: int, weights: dict[str, torch.Tensor], staleness: int) -> None:
        """Keep the adapter `weights` just published as `version`; drop those no batch may still come from (more
        than `staleness` versions back) but the one before the oldest."""
        self.behaviour = {v: w for v, w in self.behaviour.items() if v >= version - staleness - 1}
        self.behaviour[version] = weights

    def forget(self) -> None:
        """Drop every kept adapter: a batch sampled before a restored checkpoint is never trained on after it
        (step/cadence.py)."""
        self.behaviour = {}

    def version_votes(
        self,
        batch: RolloutBatch,
        recomputed: torch.Tensor,
        publisher: PolicyPublisher,
        sampled: Callable[[RolloutBatch], torch.Tensor],
    ) -> list[float]:
        """The version test's sums (objectives/sampler_check.py, version_votes and vote_sums; VERSION_TESTS' order)
        over up to VERSION_TEST_ROWS rows spread over the batch, recomputed with `sampled` (the learner's log-probs
        as an update computes them) under the version before the batch's and under the base model (lora_B set to 0:
        v0), each swapped in by `publisher`. Zeros for a comparison that cannot differ or is not held: v0's
        batches, the previous version after a restore. Shapes: recomputed [B, Tr]."""
        previous = self.behaviour.get(batch.policy_version - 1)
        if batch.policy_version == 0:
            return [0.0] * 4 * len(VERSION_TESTS)
        rows = version_test_rows(batch.response_mask.sum(-1).tolist())
        part = batch.select(rows)
        live = publisher.adapter_outbox().tensors
        with publisher.swapped({k: torch.zeros_like(v) for k, v in live.items() if "lora_B" in k}, partial=True):
            base = sampled(part)  # the adapter's delta is 0: the base model, as disable_adapter()
        if previous is None:
            before = None
        elif batch.policy_version == 1:  # v0 is the base model
            before = base
        else:
            with publisher.swapped(previous):
                before = sampled(part)
        olders = (before, base)  # VERSION_TESTS' order
        return version_test_sums(part.rollout_log_probs, recomputed[rows], part.response_mask, olders)
