"""The strict-sync step (DESIGN.md): publish, load and verify, generate, score, reward, update.

Publishing and verifying belong to miniverl/step/sync.py (PolicySync), which proves by probe that each rollout
replica serves the learner's policy, at most once per learner version. The adapter goes from the learner
to the replicas once, never through the driver: the driver reads only the policy's identity (its version
and the learner's digest).

With `staleness=1` (trainer.staleness) the rollout of step k+1 is submitted, from the policy the learner
holds before step k's update (proven served like any other), before that update starts, so generation and
scoring run while the learner trains; step k+1 then trains on it, one version behind (docs/objectives.md,
"One-step-stale rollouts"). Nothing else changes: the same refresh, stamp check and learner refusal.

Each role may have several replicas (one per GPU when scaled out): rollout and scorer replicas take
contiguous shards of whole prompt groups, learner ranks take shards of the batch and sum their
gradients. With one replica of each, every shard is the whole batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from miniverl.batches import PromptBatch, RolloutBatch, TeacherScores, concat_rollouts, concat_scores, group_bounds
from miniverl.cluster.actors import fetch, settle, submit
from miniverl.config import PROBE_EVERY
from miniverl.errors import PolicyMismatchError
from miniverl.objectives.aggregation import masked_mean
from miniverl.policy import PolicyIdentity
from miniverl.rollout.sampling import SamplingParams
from miniverl.routing import TeacherRouting, source_metrics
from miniverl.step.sync import PolicySync

# How per-rank learner metrics combine: most are sums over the step's tokens (each rank divides by the
# whole step's token count); these are equal on every rank, or a maximum.
SAME_ON_EVERY_RANK = (
    "grad_norm",
    "response_tokens",
    "sampler_vs_previous_z",
    "sampler_vs_base_z",
    "sampler_vs_previous_armed",
    "sampler_vs_base_armed",
    "sampler_version_tokens",
    "sampler_gap_z",  # the sequential tests (objectives/sequential_check.py) judge the whole step's sums
    "sampler_gap_cusum",
    "sampler_vs_previous_cusum",
    "sampler_vs_base_cusum",
)
MAX_OVER_RANKS = ("sampler_gap_max", "sampler_gap_p99", "policy_drift_max", "ratio_max", "micro_batch_tokens")
MAX_OVER_RANKS_PREFIX = "time/update/"  # the learner's own split of its update (workers/learner.py update_split)


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list | tuple) else [x]


@dataclass
class InFlight:
    """A rollout submitted to the replicas and not collected yet: its handles (Ray refs, or values
    in-process), the replicas' busy-window handles, the identity proven served when it was submitted, and
    the prompt uids it samples (the step it belongs to)."""

    parts: list[Any]
    windows: list[Any]
    identity: PolicyIdentity
    uid: list[str]
    score: Any = None  # its teacher scores' handle, submitted behind it (score_behind)


def overlap_seconds(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two wall-clock intervals (start, end) have in common; 0 when they are disjoint."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def span(windows: list[tuple[float, float]]) -> tuple[float, float]:
    """The interval from the first start to the last end of several actors' busy windows."""
    return min(w[0] for w in windows), max(w[1] for w in windows)


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
        staleness: int = 0,
        weight_sync: str = "auto",
        probe_every: int = PROBE_EVERY,
    ) -> None:
        """`probe`: the fixed token sequences every refresh is verified on; None draws them from the learner's
        vocabulary at the first refresh (miniverl.served_policy.draw_probe). `routing`: several teachers
        (miniverl/routing.py): each step also logs metrics per source and teacher. `staleness`
        (trainer.staleness): 1 overlaps the next step's rollout with this step's update. `weight_sync`
        (resources.weight_sync): how the adapter reaches the replicas; `probe_every` (trainer.probe_every): how
        often a refresh also runs the probe (miniverl/step/sync.py)."""
        self.routing = routing
        self.rollouts, self.scorers = _as_list(rollout), _as_list(scorer)
        self._learners = _as_list(learner)
        self.reward_fn = reward_fn
        self.teacher_support_k = teacher_support_k
        self.loss_temperature = loss_temperature
        self.sync = PolicySync(self.rollouts, self.learners, probe, weight_sync, probe_every)
        self.staleness = staleness
        self.in_flight: InFlight | None = None  # the next step's rollout, submitted during this step's update
        self._last_update = (0.0, 0.0)  # the learners' busy window in the previous step

    @property
    def learners(self) -> list[Any]:
        return self._learners

    @learners.setter
    def learners(self, learners: list[Any]) -> None:
        """Other learner actors (a restored one): the policy they hold must be published and proven anew, and a
        rollout in flight (of a version they never published) is dropped, as on resume."""
        self._learners = self.sync.learners = _as_list(learners)
        self.sync.learner_updated()
        self.in_flight = None

    def ensure_served(self) -> PolicyIdentity:
        """The policy the rollout side provably serves; published and proven at most once per learner
        version (miniverl/step/sync.py), whoever asks: the conformance gate, evaluation or a training step."""
        return self.sync.ensure_served()

    @property
    def last_probe(self) -> dict[str, float]:
        return self.sync.last_probe

    def submit_sample(self, prompts: PromptBatch, params: SamplingParams, identity: PolicyIdentity) -> InFlight:
        """Start generating on every replica (its shard of whole prompt groups) without waiting."""
        shards = [(a, b) for a, b in group_bounds(prompts.uid, len(self.rollouts)) if b > a]
        replicas = self.rollouts[: len(shards)]
        parts = [
            submit(r, "generate", prompts.select(list(range(a, b))), params, a * params.n)
            for r, (a, b) in zip(replicas, shards)
        ]
        windows = [submit(r, "busy_window") for r in replicas]  # runs right after that replica's generate
        return InFlight(parts, windows, identity, list(prompts.uid))

    def collect(self, flight: InFlight) -> tuple[RolloutBatch, tuple[float, float]]:
        """Wait for a submitted rollout; returns it and the replicas' busy window. Its stamp must be the
        version proven served when it was submitted."""
        rollouts = concat_rollouts(fetch(flight.parts))
        if rollouts.policy_version != flight.identity.version:
            raise PolicyMismatchError(
                f"rollouts are stamped v{rollouts.policy_version}, expected v{flight.identity.version}"
            )
        return rollouts, span(fetch(flight.windows))

    @staticmethod
    def whole_batch(flight: InFlight) -> Any:
        """The handle of the batch `flight` samples when one replica samples all of it (its own Ray ref, or the
        value in-process), which a single scorer or learner can take by reference; else None (several replicas'
        rows come padded to their own widths, so they go as rows of the driver's stacked batch)."""
        return flight.parts[0] if len(flight.parts) == 1 else None

    def score_behind(self, flight: InFlight) -> InFlight:
        """`flight` with its teacher scores submitted behind it: the scorer takes the rollout by reference and
        starts when it ends, so one behind (trainer.staleness=1) the next step's scoring runs beside this step's
        update as its rollout does, instead of after it (the one-behind runs of lab/results/decode-profile.md
        spent score + update in series: 1.54 + 3.19 s of a 4.85 s step). The teacher's scores do not depend on
        the policy, so scoring early changes no number. One scorer and one replica's whole batch only (whole_batch)."""
        source = self.whole_batch(flight)
        if source is None or len(self.scorers) != 1:
            return flight
        return dataclasses.replace(flight, score=self._score_whole(source, self.teacher_support_k))

    def _score_whole(self, source: Any, support_k: int | None) -> Any:
        """The one scorer's handle of the scores of a whole batch it takes by reference (`source`)."""
        return submit(self.scorers[0], "score", source, support_k, self.loss_temperature)

    def sample(self, prompts: PromptBatch, params: SamplingParams, identity: PolicyIdentity) -> RolloutBatch:
        return self.collect(self.submit_sample(prompts, params, identity))[0]

    def score(self, rollouts: RolloutBatch, support_k: int | None, source: Any = None) -> list[tuple[Any, int, int]]:
        """The teacher's scores of `rollouts`, one part per scorer replica: (handle, first row, end row).
        A handle is a Ray ref (a value in-process): the scores go from scorer to learner, never through
        the driver (at the 4080 recipe they are most of a step's bytes). `source`: the batch's own handle from
        its one rollout replica, which one scorer takes by reference instead of the driver's copy."""
        if source is not None and len(self.scorers) == 1:
            return [(self._score_whole(source, support_k), 0, len(rollouts.uid))]
        shards = [(a, b) for a, b in group_bounds(rollouts.uid, len(self.scorers)) if b > a]
        return [
            (submit(scorer, "score", rollouts.rows(a, b), support_k, self.loss_temperature), a, b)
            for scorer, (a, b) in zip(self.scorers, shards)
        ]

    @staticmethod
    def fetch_scores(parts: list[tuple[Any, int, int]]) -> TeacherScores:
        """The scores themselves, in the driver: for evaluation's reverse KL, which scores without a support (the
        sampled tokens' log-probs, [B, Tr]), and for tests. A training step never calls it: its scores carry the
        [B, Tr, K] support and go from scorer to learner (submit_update)."""
        return concat_scores(fetch([handle for handle, _, _ in parts]))

    def update(
        self, rollouts: RolloutBatch, parts: list[tuple[Any, int, int]], rewards: torch.Tensor, source: Any = None
    ) -> dict[str, float]:
        """The learners' update of this batch, waited for (submit_update, then finish_update)."""
        return self.finish_update(self.submit_update(rollouts, parts, rewards, source))

    def submit_update(
        self, rollouts: RolloutBatch, parts: list[tuple[Any, int, int]], rewards: torch.Tensor, source: Any = None
    ) -> list[Any]:
        """Start the update on every learner rank without waiting; returns the ranks' handles.
        Every rank takes one shard of whole groups (possibly empty) and the step's token count.
        A rank whose rows one scorer replica scored gets that replica's scores by reference; otherwise (different
        replica counts) it gets, by reference too, the parts that hold its rows and stacks them itself
        (LearnerWorker.update_parts): the driver never fetches the scores. `source`: the batch's own handle from its
        one rollout replica, which one learner takes by reference instead of the driver's copy."""
        tokens = int(rollouts.response_mask.sum())
        by_reference = source is not None and len(self.learners) == 1  # then the one shard is the whole batch
        shards = group_bounds(rollouts.uid, len(self.learners))
        by_rows = {(a, b): handle for handle, a, b in parts}
        handles = []
        for learner, (a, b) in zip(self.learners, shards):
            batch = source if by_reference else rollouts.rows(a, b)
            if (a, b) in by_rows:
                handles.append(submit(learner, "update", batch, by_rows[a, b], rewards[a:b], tokens))
                continue
            holding = parts_holding(parts, a, b)
            first = holding[0][1]
            rows = (a - first, b - first)  # this rank's rows within the parts stacked
            scores = [handle for handle, _, _ in holding]
            handles.append(submit(learner, "update_parts", batch, rewards[a:b], tokens, *rows, *scores))
        return handles

    def finish_update(self, handles: list[Any]) -> dict[str, float]:
        """Wait for the ranks' updates; their metrics combined. A skipped (non-finite) step leaves the policy
        and its version as they were."""
        metrics = combine_rank_metrics(fetch(handles))
        if not metrics["skipped_step"]:
            self.sync.learner_updated()
        return metrics

    def step(
        self,
        prompts: PromptBatch,
        params: SamplingParams,
        upcoming: tuple[PromptBatch, SamplingParams] | None = None,
    ) -> dict[str, float]:
        """One step on `prompts`. With staleness 1, `upcoming` is the next step's (prompts, params): its rollout
        is submitted from the policy the learner holds now, before this step's update, and the next call
        trains on it; None (the last step) submits nothing. A step with nothing in flight (the first, or the
        first after a resume) samples its own batch from the current policy (lag 0).

        The time split sums to the step's wall time: refresh (publish and prove), generate (waiting for this
        step's rollout: all of it in strict sync, what is left of it when it ran during the last update),
        score (the teacher scoring this step's rows, waited for in the driver without fetching the scores, and
        the rewards) and update (the learner's update)."""
        times = dict.fromkeys(("refresh", "generate", "score", "update"), 0.0)
        t0 = mark = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            times[phase] += now - mark
            mark = now

        flight, self.in_flight = self.in_flight, None
        if flight is None:
            identity = self.ensure_served()
            lap("refresh")
            flight = self.submit_sample(prompts, params, identity)
        elif flight.uid != list(prompts.uid):
            raise RuntimeError(f"the rollout in flight was sampled for prompts {flight.uid[:2]}..., not this step's")
        rollouts, generated = self.collect(flight)
        self.sync.remember(rollouts)
        lap("generate")
        identity = self.ensure_served()  # the learner's current version (a no-op in strict sync: proven above)
        lap("refresh")
        if self.staleness and upcoming is not None:
            self.in_flight = self.submit_sample(*upcoming, identity)
        # handles; the learner fetches them. A rollout that was in flight was scored as soon as it ended, beside
        # the last update
        source = self.whole_batch(flight)
        if flight.score is None:
            scores = self.score(rollouts, self.teacher_support_k, source)
        else:
            scores = [(flight.score, 0, len(rollouts.uid))]
        rewards = self.reward_fn(rollouts)
        # The update cannot start before its scores exist (Ray resolves them first), so waiting here costs a
        # round trip and keeps time/score the teacher's and time/update the learner's (the 4080 recipe on 2026-12-01,
        # lab/results/qlora-4080.md, logged score 0.13 s and update 7.18 s when the wait was inside the update).
        settle([handle for handle, _, _ in scores])
        lap("score")
        updating = self.submit_update(rollouts, scores, rewards, source)
        if self.in_flight is not None:
            # submitted after the update: calls from this driver to one actor run in submission order, so a
            # scoring submitted first would hold a colocated actor's update until the next rollout had ended
            # (lab/results/decode-profile.md, 2026-12-04: 5.64 s a step, no overlap, against 4.85 s without scoring
            # behind)
            self.in_flight = self.score_behind(self.in_flight)
        metrics = self.finish_update(updating)
        overlap = overlap_seconds(generated, self._last_update)  # this step's rollout against the last update
        self._last_update = span(fetch([submit(learner, "busy_window") for learner in self.learners]))
        lap("update")
        return {
            **metrics,  # reverse_kl among them: the learner holds the teacher's log-probs
            **rollout_metrics(rollouts, rewards),
            **self.routed_metrics(rollouts, scores, rewards, source),
            **self.last_probe,
            "policy_version": rollouts.policy_version,
            "staleness": identity.version - rollouts.policy_version,
            **{f"time/{phase}": seconds for phase, seconds in times.items()},
            "time/step": mark - t0,
            "time/overlap": overlap,
            "rollout_tokens_per_s": float(rollouts.response_mask.sum()) / max(generated[1] - generated[0], 1e-9),
        }

    def routed_metrics(
        self, rollouts: RolloutBatch, parts: list[tuple[Any, int, int]], rewards: torch.Tensor, source: Any = None
    ) -> dict[str, float]:
        """Per source and teacher (several teachers only). The scorer that made each part of the scores sums their
        k1 per source and teacher (workers/teachers.py source_kl) and the driver fetches only those sums (the scores
        go to the learner by reference and nowhere else); accuracy and row counts come from the driver's rewards.
        `source`: the batch's own handle from its one rollout replica, as in `score`."""
        if self.routing is None:
            return {}
        calls = []
        for scorer, (handle, a, b) in zip(self.scorers, parts):  # parts[i] was scored by scorers[i]
            whole = source is not None and (a, b) == (0, len(rollouts.uid))
            calls.append(submit(scorer, "source_kl", source if whole else rollouts.rows(a, b), handle))
        return source_metrics(rollouts.data_source, self.routing, fetch(calls), rewards)


def parts_holding(parts: list[tuple[Any, int, int]], start: int, stop: int) -> list[tuple[Any, int, int]]:
    """The scorer parts (handle, first row, end row), in row order, that hold rows [start, stop) of the batch; for
    no rows (a learner rank beyond the last group) the part that ends there, whose empty slice has the support's
    shape. `parts` cover the batch's rows in order, without gaps."""
    inside = [p for p in parts if p[1] < stop and p[2] > start]
    return inside or [next(p for p in parts if p[1] <= start <= p[2])]


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    out = dict(per_rank[0])
    for key in out:
        if key in MAX_OVER_RANKS or key.startswith(MAX_OVER_RANKS_PREFIX):
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
    if rollouts.teacher_prompt_mask is not None:  # the teacher's privileged context is there, and this long
        out["teacher_prompt_tokens"] = float(rollouts.teacher_prompt_mask.sum(1).float().mean())
    if teacher_log_probs is not None:
        out["reverse_kl"] = float(masked_mean(rollouts.rollout_log_probs - teacher_log_probs, mask))
    return out
