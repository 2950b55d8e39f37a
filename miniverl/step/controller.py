"""The strict-sync step (DESIGN.md): publish, load and verify, generate, score, reward, update.

Publishing and verifying belong to miniverl/step/sync.py (PolicySync), which proves by probe that each rollout
replica serves the learner's policy, at most once per learner version. The adapter goes from the learner
to the replicas once, never through the driver: the driver reads only the policy's identity (its version
and the learner's digest).

Each role may have several replicas (one per GPU when scaled out): rollout and scorer replicas take
contiguous shards of whole prompt groups, learner ranks take shards of the batch and sum their
gradients. With one replica of each, every shard is the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from miniverl.batches import PromptBatch, RolloutBatch, TeacherScores, concat_rollouts, concat_scores, group_bounds
from miniverl.cluster.actors import call_all, fetch, submit
from miniverl.errors import PolicyMismatchError
from miniverl.objectives.aggregation import masked_mean
from miniverl.policy import PolicyIdentity
from miniverl.rollout.sampling import SamplingParams
from miniverl.setup.teachers import TeacherRouting, source_metrics
from miniverl.step.sync import PolicySync

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
        """`probe`: the fixed token sequences every refresh is verified on; None draws them from the learner's
        vocabulary at the first refresh (miniverl.step.served_policy.draw_probe). `routing`: several teachers
        (miniverl/setup/teachers.py): each step also logs metrics per source and teacher."""
        self.routing = routing
        self.rollouts, self.scorers = _as_list(rollout), _as_list(scorer)
        self._learners = _as_list(learner)
        self.reward_fn = reward_fn
        self.teacher_support_k = teacher_support_k
        self.loss_temperature = loss_temperature
        self.sync = PolicySync(self.rollouts, self.learners, probe)

    @property
    def learners(self) -> list[Any]:
        return self._learners

    @learners.setter
    def learners(self, learners: list[Any]) -> None:
        """Other learner actors (a restored one): the policy they hold must be published and proven anew."""
        self._learners = self.sync.learners = _as_list(learners)
        self.sync.learner_updated()

    def ensure_served(self) -> PolicyIdentity:
        """The policy the rollout side provably serves; published and proven at most once per learner
        version (miniverl/step/sync.py), whoever asks: the conformance gate, evaluation or a training step."""
        return self.sync.ensure_served()

    @property
    def last_probe(self) -> dict[str, float]:
        return self.sync.last_probe

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

    def score(self, rollouts: RolloutBatch, support_k: int | None) -> list[tuple[Any, int, int]]:
        """The teacher's scores of `rollouts`, one part per scorer replica: (handle, first row, end row).
        A handle is a Ray ref (a value in-process): the scores go from scorer to learner, never through
        the driver (at the 4080 recipe they are most of a step's bytes)."""
        shards = [(a, b) for a, b in group_bounds(rollouts.uid, len(self.scorers)) if b > a]
        return [
            (submit(scorer, "score", rollouts.rows(a, b), support_k, self.loss_temperature), a, b)
            for scorer, (a, b) in zip(self.scorers, shards)
        ]

    @staticmethod
    def fetch_scores(parts: list[tuple[Any, int, int]]) -> TeacherScores:
        """The scores themselves, in the driver (evaluation's reverse KL; shards that do not line up)."""
        return concat_scores(fetch([handle for handle, _, _ in parts]))

    def update(
        self, rollouts: RolloutBatch, parts: list[tuple[Any, int, int]], rewards: torch.Tensor
    ) -> dict[str, float]:
        """Every learner rank takes one shard of whole groups (possibly empty) and the step's token count.
        A rank whose rows one scorer replica scored gets that replica's scores by reference; otherwise
        (different replica counts) the driver fetches and slices them."""
        tokens = int(rollouts.response_mask.sum())
        shards = group_bounds(rollouts.uid, len(self.learners))
        by_rows = {(a, b): handle for handle, a, b in parts}
        whole: list[TeacherScores] = []
        args = []
        for a, b in shards:
            scores = by_rows.get((a, b))
            if scores is None:
                whole = whole or [self.fetch_scores(parts)]
                scores = whole[0].rows(a, b)
            args.append((rollouts.rows(a, b), scores, rewards[a:b], tokens))
        metrics = combine_rank_metrics(call_all(self.learners, "update", args))
        if not metrics["skipped_step"]:  # a skipped (non-finite) step leaves the policy and its version as they were
            self.sync.learner_updated()
        return metrics

    def step(self, prompts: PromptBatch, params: SamplingParams) -> dict[str, float]:
        t0 = time.perf_counter()
        identity = self.ensure_served()
        t1 = time.perf_counter()
        rollouts = self.sample(prompts, params, identity)
        self.sync.remember(rollouts)
        t2 = time.perf_counter()
        scores = self.score(rollouts, self.teacher_support_k)  # handles; the learner fetches them
        rewards = self.reward_fn(rollouts)
        t3 = time.perf_counter()
        metrics = self.update(rollouts, scores, rewards)  # time/update includes the wait for the scores
        t4 = time.perf_counter()
        return {
            **metrics,  # reverse_kl among them: the learner holds the teacher's log-probs
            **rollout_metrics(rollouts, rewards),
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

    def routed_metrics(
        self, rollouts: RolloutBatch, parts: list[tuple[Any, int, int]], rewards: torch.Tensor
    ) -> dict[str, float]:
        """Per source and teacher (several teachers only): the driver fetches the scores for these, so with
        several teachers the scores move twice (the learner's copy still goes by reference)."""
        if self.routing is None:
            return {}
        scores = self.fetch_scores(parts)
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


def rollout_metrics(
    rollouts: RolloutBatch, rewards: torch.Tensor, teacher_log_probs: torch.Tensor | None = None
) -> dict[str, float]:
    """Metrics shared by every objective, so their curves are comparable.

    reverse_kl (when the teacher's log-probs are given; in a training step the learner reports it) is the
    k1 estimate `mean_t [log q(y_t) - log p(y_t)]` over sampled tokens (the sampler's log-probs against
    the teacher's), an unbiased per-token estimate of KL(q || p) only when the tokens were sampled from q
    itself: temperature 1, no top-k/top-p. With other sampling settings (allowed for gkd) the
    training-step value is biased; the evaluation always samples at temperature 1.
    """
    mask = rollouts.response_mask.float()
    out = {
        "reward": float(rewards.mean()),
        "accuracy": float((rewards > 0.5).float().mean()),
        "response_length": float(mask.sum(1).mean()),
        "finished_frac": float(rollouts.finished.float().mean()),
    }
    if teacher_log_probs is not None:
        out["reverse_kl"] = float(masked_mean(rollouts.rollout_log_probs - teacher_log_probs, mask))
    return out
