"""The one owner of the served policy: publish and prove at most once per learner version.

Every caller that needs the rollout side to serve the learner's current policy (the conformance gate,
evaluation, the training step) calls `PolicySync.ensure_served()`. It publishes and proves only when the
learner moved since the last proof (`learner_updated()` after an applied optimizer step), so a run
refreshes exactly updates + 1 times, and every refresh compares two different policy versions.

A refresh is proven by two separate tests on a probe (miniverl/step/served_policy.py), each replica on its own:
- the gap test: the served probe sits within the backend's tolerance of the learner's;
- the change test: when the learner's probe moved, the served probe moved by more than the replica's
  own noise (measured once, by probing the same weights twice; 0 for a deterministic engine). A stale
  replica fails it at its first stale refresh, however small the step was.
The probe holds fixed sequences (the same for the whole run) and the most recent on-policy rows (the
tokens a trained adapter moves most). The change test compares only sequences both refreshes scored.

How the adapter travels is decided once, at the first refresh (resources.weight_sync): `auto` leaves it on
the learner's GPU when every rollout replica reports the learner's physical GPU (its UUID), and each replica
copies it device to device from the mapped buffer (miniverl/policy.py, SharedWeights); otherwise, and always
with `host`, CPU copies go through Ray's object store. The conformance gate's trial adapter always goes
through the host (it is made once per run).
"""

from __future__ import annotations

import time
from typing import Any

from miniverl.batches import RolloutBatch
from miniverl.cluster.actors import call, fetch, settle, submit
from miniverl.config import WEIGHT_SYNC
from miniverl.errors import PolicyMismatchError
from miniverl.policy import PolicyIdentity
from miniverl.step.served_policy import check_changed, check_gap, max_gap

RECENT_ROWS = 2  # on-policy rows of the last training batch added to the probe (one short prefill more)
TRIAL_SEED = 1  # the conformance gate's non-zero adapter (one per run; the same in every run)
# lora_B of the trial adapter: with lora_A's default init (|A x| ~ 1 per rank) and alpha/r ~ 2, a delta of
# a few hundredths per output, far above fp32 rounding and enough to move a bf16 probe.
TRIAL_STD = 0.02


def _probe_rows(batch: RolloutBatch, count: int) -> list[tuple[int, ...]]:
    """Prompt + sampled response of `count` rows spread over the batch, as token tuples."""
    rows = []
    step = max(1, len(batch) // count)
    for i in range(0, len(batch), step)[:count]:
        prompt = batch.prompts[i][batch.prompt_mask[i].bool()].tolist()
        response = batch.responses[i][batch.response_mask[i].bool()].tolist()
        if len(prompt) + len(response) >= 2:
            rows.append(tuple(prompt + response))
    return rows


class PolicySync:
    """Publishes the learner's policy to every rollout replica and proves each serves it."""

    def __init__(
        self, rollouts: list[Any], learners: list[Any], probe: list[list[int]] | None = None, weight_sync: str = "auto"
    ) -> None:
        """`probe`: the fixed sequences; None draws them from the learner's vocabulary at the first refresh.
        `weight_sync` (resources.weight_sync): auto | host, see the module note."""
        if weight_sync not in WEIGHT_SYNC:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC}, got {weight_sync!r}")
        self.rollouts, self.learners = rollouts, learners
        self.weight_sync = weight_sync
        self.on_device: bool | None = None  # decided at the first refresh
        self.fixed = None if probe is None else [tuple(s) for s in probe]
        self.identity: PolicyIdentity | None = None  # what every replica provably serves now
        self.refreshes = 0  # publish-and-prove rounds so far
        self.tolerances: list[float] = []  # per replica, read once
        self.noise: list[float] = []  # per replica: max gap of two probes of the same weights
        self.last_probe: dict[str, float] = {}  # what the last refresh measured (logged per step)
        self._recent: list[tuple[int, ...]] = []  # on-policy rows for the next refresh's probe
        self._carried: list[tuple[int, ...]] = []  # the rows the last refresh scored, compared again
        # sequence -> (served log-probs per replica, learner log-probs) at the last refresh
        self._previous: dict[tuple[int, ...], tuple[list[list[float]], list[float]]] = {}

    def learner_updated(self) -> None:
        """The learner applied an optimizer step: the served policy is now one version behind."""
        self.identity = None

    def remember(self, batch: RolloutBatch) -> None:
        """Add a few of this training batch's rows to the next refresh's probe."""
        self._recent = _probe_rows(batch, RECENT_ROWS)

    def ensure_served(self) -> PolicyIdentity:
        """The policy every replica serves, published and proven first unless it is already current."""
        if self.identity is None:
            self.identity = self._refresh()
        return self.identity

    def prove_trial_adapter(self) -> float:
        """Serve and prove a non-zero trial adapter (the gate, before v0 is served): at v0 lora_B is 0, so a
        replica that merges wrongly or drops the adapter term serves v0 exactly. The gap test runs on it
        now; the change test runs at the next refresh (v0 against the trial), which then publishes the
        learner's real policy. Returns the max gap under the trial adapter (nats)."""
        self._refresh(trial=True)
        self.identity = None  # the replicas hold the trial adapter now
        return self.last_probe["probe_gap_max"]

    def _shares_the_learners_gpu(self) -> bool:
        """Whether the adapter can stay on the device: weight_sync auto, learner rank 0 on a GPU, and every
        rollout replica on that same physical GPU."""
        if self.weight_sync != "auto":
            return False
        learner, *replicas = fetch([submit(a, "device_uuid") for a in (self.learners[0], *self.rollouts)])
        return learner is not None and all(r == learner for r in replicas)

    def _sequences(self) -> list[tuple[int, ...]]:
        seen: dict[tuple[int, ...], None] = {}
        for s in (*self.fixed, *self._carried, *self._recent):
            seen.setdefault(s, None)
        return list(seen)

    def _refresh(self, trial: bool = False) -> PolicyIdentity:
        """All calls are submitted at once; each actor runs its calls in submission order. The learner's
        probe goes first: the replicas wait for the snapshot, so no two actors compute at once (on the CPU,
        two all-core thread pools at once made a refresh 10x slower: measured). The snapshot stays a ref
        here: the driver never holds the weights; the replicas report its name."""
        if self.fixed is None:
            self.fixed = [tuple(s) for s in call(self.learners[0], "probe_sequences")]
        if not self.tolerances:
            self.tolerances = fetch([submit(r, "probe_tolerance") for r in self.rollouts])
        if self.on_device is None:
            self.on_device = self._shares_the_learners_gpu()
        sequences = self._sequences()
        probe = [list(s) for s in sequences]
        first = not self.noise
        if trial:
            snapshot = submit(self.learners[0], "trial_snapshot", TRIAL_SEED, TRIAL_STD)
            learner = submit(self.learners[0], "probe_logprobs_with", snapshot, probe)
            others = []
        else:
            learner = submit(self.learners[0], "probe_logprobs", probe)
            snapshot = submit(self.learners[0], "publish_policy", True, self.on_device)
            others = [submit(rank, "publish_policy", False) for rank in self.learners[1:]]
        loaded = [submit(r, "load_policy", snapshot) for r in self.rollouts]
        served = [submit(r, "probe_logprobs", probe) for r in self.rollouts]
        again = [submit(r, "probe_logprobs", probe) for r in self.rollouts] if first else []
        stages = [("publish", [snapshot, *others]), ("learner_probe", [learner])]
        stages = stages if trial else stages[::-1]  # in the order the learner runs them
        timing = _stage_times([*stages, ("load", loaded), ("served_probe", served + again)])
        k, r = len(others), len(loaded)
        learner, *rest = fetch([learner, *others, *loaded, *served, *again])
        others, loaded, served, again = rest[:k], rest[k : k + r], rest[k + r : k + 2 * r], rest[k + 2 * r :]
        if first:  # the replica's own noise floor: the same weights probed twice
            self.noise = [max_gap(a, b) for a, b in zip(served, again)]
        identity = loaded[0]  # the name every replica received with the learner's snapshot
        for rank, other in enumerate(others, start=1):
            if other.identity != identity:
                raise PolicyMismatchError(
                    f"learner rank {rank} holds {other.identity.short()} but rank 0 published {identity.short()};"
                    " data-parallel ranks diverged, so the run stops"
                )
        common = [j for j, s in enumerate(sequences) if s in self._previous]
        gaps, learner_moved = [], 0.0
        if common:
            learner_moved = max_gap([learner[j] for j in common], [self._previous[sequences[j]][1] for j in common])
        for i, (name, probe_i) in enumerate(zip(loaded, served)):
            if name != identity:
                raise PolicyMismatchError(
                    f"rollout replica {i} serves {name.short()} but replica 0 serves {identity.short()} of the"
                    " same snapshot; a worker did not take the new snapshot, so the run stops"
                )
            gaps.append(check_gap(i, identity.version, probe_i, learner, self.tolerances[i]))
            if common:
                now = [probe_i[j] for j in common]
                before = [self._previous[sequences[j]][0][i] for j in common]
                check_changed(i, identity.version, max_gap(now, before), learner_moved, self.noise[i])
        self._previous = {s: ([p[j] for p in served], learner[j]) for j, s in enumerate(sequences)}
        self._carried, self._recent = self._recent, []
        self.refreshes += 0 if trial else 1
        self.last_probe = {"probe_gap_max": max(gaps), "probe_learner_moved": learner_moved, **timing}
        return identity


def _stage_times(stages: list[tuple[str, list[Any]]]) -> dict[str, float]:
    """Seconds each refresh stage took, as the driver sees them end (`time/refresh/<stage>`): the actors run
    the stages one after the other (the replicas wait for the snapshot), so waiting for each in turn splits
    the refresh without fetching anything. In-process every stage has already run: all read ~0."""
    out, last = {}, time.perf_counter()
    for name, handles in stages:
        settle(handles)
        now = time.perf_counter()
        out[f"time/refresh/{name}"], last = now - last, now
    return out
