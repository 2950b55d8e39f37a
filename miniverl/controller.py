"""The strict-sync step (DESIGN.md): publish, load and verify, generate, score, reward, update."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from miniverl.actors import call
from miniverl.objectives.aggregation import masked_mean
from miniverl.protocol import PolicyIdentity, PolicyMismatchError, PromptBatch, RolloutBatch, TeacherScores
from miniverl.rollout.sampling import SamplingParams


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
    ) -> None:
        self.rollout, self.scorer, self.learner = rollout, scorer, learner
        self.reward_fn = reward_fn
        self.teacher_support_k = teacher_support_k
        self.loss_temperature = loss_temperature

    def refresh(self) -> PolicyIdentity:
        """Publish the learner's policy and prove the rollout side now serves exactly it."""
        snapshot = call(self.learner, "publish_policy")
        served = call(self.rollout, "load_policy", snapshot)
        if served != snapshot.identity:
            raise PolicyMismatchError(
                f"rollout serves {served.short()} but the learner published {snapshot.identity.short()};"
                " the engine did not load the new weights (stale worker or broken weight sync), so the run stops"
            )
        return snapshot.identity

    def sample(self, prompts: PromptBatch, params: SamplingParams, identity: PolicyIdentity) -> RolloutBatch:
        rollouts = call(self.rollout, "generate", prompts, params)
        if rollouts.policy_version != identity.version:
            raise PolicyMismatchError(f"rollouts are stamped v{rollouts.policy_version}, expected v{identity.version}")
        return rollouts

    def score(self, rollouts: RolloutBatch, support_k: int | None) -> TeacherScores:
        return call(self.scorer, "score", rollouts, support_k, self.loss_temperature)

    def step(self, prompts: PromptBatch, params: SamplingParams) -> dict[str, float]:
        t0 = time.perf_counter()
        identity = self.refresh()
        t1 = time.perf_counter()
        rollouts = self.sample(prompts, params, identity)
        t2 = time.perf_counter()
        scores = self.score(rollouts, self.teacher_support_k)
        rewards = self.reward_fn(rollouts)
        t3 = time.perf_counter()
        metrics = call(self.learner, "update", rollouts, scores, rewards)
        t4 = time.perf_counter()
        return {
            **metrics,
            **rollout_metrics(rollouts, scores, rewards),
            "policy_version": identity.version,
            "time/refresh": t1 - t0,
            "time/generate": t2 - t1,
            "time/score": t3 - t2,
            "time/update": t4 - t3,
            "time/step": t4 - t0,
        }


def rollout_metrics(rollouts: RolloutBatch, scores: TeacherScores, rewards: torch.Tensor) -> dict[str, float]:
    """Metrics shared by every objective, so their curves are comparable.

    reverse_kl is the k1 estimate `mean_t [log q(y_t) - log p(y_t)]` over sampled tokens (the sampler's
    log-probs against the teacher's), an unbiased per-token estimate of KL(q || p) at temperature 1.
    """
    mask = rollouts.response_mask.float()
    return {
        "reverse_kl": float(masked_mean(rollouts.rollout_log_probs - scores.teacher_log_probs, mask)),
        "reward": float(rewards.mean()),
        "accuracy": float((rewards > 0.5).float().mean()),
        "response_length": float(mask.sum(1).mean()),
        "finished_frac": float(rollouts.finished.float().mean()),
    }
