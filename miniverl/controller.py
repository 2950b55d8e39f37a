"""The strict-sync step (DESIGN.md): publish, load and verify, generate, score, reward, update.

Verification is by probe (miniverl/probe.py): each rollout replica's served log-probs of a fixed probe
must match the learner's. The adapter goes from the learner to the replicas once, never through the
driver: the driver reads only the policy's identity (its version and the learner's digest).

Each role may have several replicas (one per GPU when scaled out): rollout and scorer replicas take
contiguous shards of whole prompt groups, learner ranks take shards of the batch and sum their
gradients. With one replica of each, every shard is the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from miniverl.actors import call, call_all, fetch, submit
from miniverl.objectives.aggregation import masked_mean
from miniverl.probe import check_served
from miniverl.protocol import (
    PolicyIdentity,
    PolicyMismatchError,
    PromptBatch,
    RolloutBatch,
    TeacherScores,
    concat_rollouts,
    concat_scores,
    group_bounds,
)
from miniverl.rollout.sampling import SamplingParams
from miniverl.teachers import TeacherRouting, source_metrics

# How per-rank learner metrics combine: most are sums over the step's tokens (each rank divides by the
# whole step's token count); these are equal on every rank, or a maximum.
SAME_ON_EVERY_RANK = ("grad_norm", "response_tokens")
MAX_OVER_RANKS = ("sampler_gap_max",)


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list | tuple) else [x]


class StrictSyncController:
    """Drives one step at a time; every rollout is provably produced by the policy just published."""

    def __init__(
        self,
        rollout: Any,
        scorer: Any,
        learner: Any,
        reward_fn: Callable[[RolloutBatch], torch.Tensor],
        teacher_support_k: int | None,
        loss_temperature: float,
        probe: list[list[int]] | None = None,
        routing: TeacherRouting | None = None,
    ) -> None:
        """`probe`: the token sequences every refresh is verified on; None draws them from the learner's
        vocabulary at the first refresh (miniverl.probe.draw_probe). Fixed for the controller's life.
        `routing`: several teachers (miniverl/teachers.py): each step also logs metrics per source and teacher."""
        self.routing = routing
        self.rollouts, self.scorers, self.learners = _as_list(rollout), _as_list(scorer), _as_list(learner)
        self.reward_fn = reward_fn
        self.teacher_support_k = teacher_support_k
        self.loss_temperature = loss_temperature
        self.probe = probe
        self.tolerances: list[float] = []  # per rollout replica, read once
        self.last_probe: dict[str, float] = {}  # what the last passing refresh measured (logged per step)
        # The probe log-probs of the last refresh that passed: (served, one per replica; learner's).
        self._previous: tuple[list[list[list[float]]], list[list[float]]] | None = None

    def refresh(self) -> PolicyIdentity:
        """Publish the learner's policy, hand it to every rollout replica, and prove by the probe that each
        now serves it. All calls are submitted at once; each actor runs its calls in submission order."""
        if self.probe is None:
            self.probe = call(self.learners[0], "probe_sequences")
        if not self.tolerances:
            self.tolerances = fetch([submit(r, "probe_tolerance") for r in self.rollouts])
        # The learner's probe goes first: the replicas wait for the snapshot, so no two actors compute at
        # once (on the CPU, two all-core thread pools at once made a refresh 10x slower: measured). The
        # snapshot stays a ref here: the driver never holds the weights; the replicas report its name.
        learner = submit(self.learners[0], "probe_logprobs", self.probe)
        snapshot = submit(self.learners[0], "publish_policy")
        others = [submit(rank, "publish_policy", False) for rank in self.learners[1:]]
        loaded = [submit(r, "load_policy", snapshot) for r in self.rollouts]
        served = [submit(r, "probe_logprobs", self.probe) for r in self.rollouts]
        k, r = len(others), len(loaded)
        learner, *rest = fetch([learner, *others, *loaded, *served])
        others, loaded, served = rest[:k], rest[k : k + r], rest[k + r :]
        identity = loaded[0]  # the name every replica received with the learner's snapshot
        for rank, other in enumerate(others, start=1):
            if other.identity != identity:
                raise PolicyMismatchError(
                    f"learner rank {rank} holds {other.identity.short()} but rank 0 published {identity.short()};"
                    " data-parallel ranks diverged, so the run stops"
                )
        checks = []
        for i, (name, probe, tolerance) in enumerate(zip(loaded, served, self.tolerances)):
            if name != identity:
                raise PolicyMismatchError(
                    f"rollout replica {i} serves {name.short()} but replica 0 serves {identity.short()} of the"
                    " same snapshot; a worker did not take the new snapshot, so the run stops"
                )
            previous = None if self._previous is None else (self._previous[0][i], self._previous[1])
            checks.append(check_served(i, identity.version, probe, learner, tolerance, previous))
        self._previous = (served, learner)
        self.last_probe = {
            "probe_gap_max": max(c["gap"] for c in checks),
            "probe_learner_moved": checks[0]["moved"],
        }
        return identity

    def sample(self, prompts: PromptBatch, params: SamplingParams, identity: PolicyIdentity) -> RolloutBatch:
        shards = [(a, b) for a, b in group_bounds(prompts.uid, len(self.rollouts)) if b > a]
        parts = call_all(
            self.rollouts[: len(shards)],
            "generate",
            [(prompts.select(list(range(a, b))), params, a * params.n) for a, b in shards],
        )
        rollouts = concat_rollouts(parts)
        if rollouts.policy_version != identity.version:
            raise PolicyMismatchError(f"rollouts are stamped v{rollouts.policy_version}, expected v{identity.version}")
        return rollouts

    def score(self, rollouts: RolloutBatch, support_k: int | None) -> TeacherScores:
        shards = [(a, b) for a, b in group_bounds(rollouts.uid, len(self.scorers)) if b > a]
        parts = call_all(
            self.scorers[: len(shards)],
            "score",
            [(rollouts.rows(a, b), support_k, self.loss_temperature) for a, b in shards],
        )
        return concat_scores(parts)

    def update(self, rollouts: RolloutBatch, scores: TeacherScores, rewards: torch.Tensor) -> dict[str, float]:
        """Every learner rank takes one shard of whole groups (possibly empty) and the step's token count."""
        tokens = int(rollouts.response_mask.sum())
        shards = group_bounds(rollouts.uid, len(self.learners))
        per_rank = call_all(
            self.learners,
            "update",
            [(rollouts.rows(a, b), scores.rows(a, b), rewards[a:b], tokens) for a, b in shards],
        )
        return combine_rank_metrics(per_rank)

    def step(self, prompts: PromptBatch, params: SamplingParams) -> dict[str, float]:
        t0 = time.perf_counter()
        identity = self.refresh()
        t1 = time.perf_counter()
        rollouts = self.sample(prompts, params, identity)
        t2 = time.perf_counter()
        scores = self.score(rollouts, self.teacher_support_k)
        rewards = self.reward_fn(rollouts)
        t3 = time.perf_counter()
        metrics = self.update(rollouts, scores, rewards)
        t4 = time.perf_counter()
        return {
            **metrics,
            **rollout_metrics(rollouts, scores, rewards),
            **self.routed_metrics(rollouts, scores, rewards),
            **self.last_probe,
            "policy_version": identity.version,
            "time/refresh": t1 - t0,
            "time/generate": t2 - t1,
            "time/score": t3 - t2,
            "time/update": t4 - t3,
            "time/step": t4 - t0,
            "rollout_tokens_per_s": float(rollouts.response_mask.sum()) / max(t2 - t1, 1e-9),
        }

    def routed_metrics(self, rollouts: RolloutBatch, scores: TeacherScores, rewards: torch.Tensor) -> dict[str, float]:
        if self.routing is None:
            return {}
        return source_metrics(
            rollouts.data_source,
            self.routing,
            rollouts.response_mask,
            rollouts.rollout_log_probs,
            scores.teacher_log_probs,
            rewards,
        )


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    out = dict(per_rank[0])
    for key in out:
        if key in MAX_OVER_RANKS:
            out[key] = max(m[key] for m in per_rank)
        elif key not in SAME_ON_EVERY_RANK:
            out[key] = sum(m[key] for m in per_rank)
    return out


def rollout_metrics(rollouts: RolloutBatch, scores: TeacherScores, rewards: torch.Tensor) -> dict[str, float]:
    """Metrics shared by every objective, so their curves are comparable.

    reverse_kl is the k1 estimate `mean_t [log q(y_t) - log p(y_t)]` over sampled tokens (the sampler's
    log-probs against the teacher's), an unbiased per-token estimate of KL(q || p) only when the tokens
    were sampled from q itself: temperature 1, no top-k/top-p. With other sampling settings (allowed for
    gkd) the training-step value is biased; the evaluation always samples at temperature 1.
    """
    mask = rollouts.response_mask.float()
    return {
        "reverse_kl": float(masked_mean(rollouts.rollout_log_probs - scores.teacher_log_probs, mask)),
        "reward": float(rewards.mean()),
        "accuracy": float((rewards > 0.5).float().mean()),
        "response_length": float(mask.sum(1).mean()),
        "finished_frac": float(rollouts.finished.float().mean()),
    }
