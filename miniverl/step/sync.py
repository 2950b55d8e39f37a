"""The one owner of the served policy: publish and prove at most once per learner version.

Every caller that needs the rollout side to serve the learner's current policy (the conformance gate,
evaluation, the training step) calls `PolicySync.ensure_served()`. It publishes and proves only when the
learner moved since the last proof (`learner_updated()` after an applied optimizer step), so a run
refreshes exactly updates + 1 times, and every refresh compares two different policy versions.

A refresh is proven, each replica on its own, by what the replica computes, never by an echo of what it was sent:
- the served digest, at every refresh: a replica whose serving path reads adapter buffers of its own
  (hf_reference: the peft model's; hf_cached: the buffers its prefill, decode step and CUDA graphs read) digests
  those buffers after the load (miniverl/policy.py, weights_digest), and the digest must be the one the learner
  published. Exact in any dtype and at any learning rate: a replica that kept, half-loaded or altered its
  adapter is caught at that refresh. O(adapter) work, on the device.
- the probe (miniverl/served_policy.py): log-probs of a few sequences through the serving path against
  the learner's. The gap test (within the backend's tolerance) proves what no adapter digest sees, the base
  model, dtype and arithmetic; the change test (when the learner's probe moved, the served one moved beyond
  the replica's own noise, measured once by probing the same weights twice) proves the adapter reached the
  serving path. The probe holds fixed sequences (the same for the whole run) and the most recent on-policy rows
  (the tokens a trained adapter moves most); the change test compares only sequences both probes scored.
  A probe is O(model) work on the learner and on every replica, so it runs at the first refresh, on the
  gate's trial adapter, and on every `probe_every`-th refresh (trainer.probe_every); and at every refresh of an
  engine that reports no served digest (vLLM keeps fused, padded copies that cannot be read back).
Besides, the learner holds the sampler's log-probs of every step's tokens to the objective's bound before its
optimizer step (LearnerWorker._check_sampler_gap).

How the adapter travels is decided once, at the first refresh (resources.weight_sync): `auto` leaves it on
the learner's GPU when every rollout replica reports the learner's physical GPU (its UUID), and each replica
copies it device to device from the mapped buffer (miniverl/policy.py, SharedWeights); otherwise, and always
with `host`, CPU copies go through Ray's object store. The conformance gate's trial adapter always goes
through the host (it is made once per run).

Round trips: one call to the learner (publish; a probe refresh adds its probe before it) and one to each replica
(`serve`: load, served digest, and the probe when one is due), submitted at once; the driver waits once per stage.
"""

from __future__ import annotations

import time
from typing import Any

from miniverl.batches import RolloutBatch
from miniverl.cluster.actors import call, fetch, settle, submit
from miniverl.config import PROBE_EVERY, WEIGHT_SYNC
from miniverl.errors import PolicyMismatchError
from miniverl.policy import DIGEST_PREFIX, PolicyIdentity, ServedPolicy
from miniverl.served_policy import check_changed, check_gap, max_gap

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
        self,
        rollouts: list[Any],
        learners: list[Any],
        probe: list[list[int]] | None = None,
        weight_sync: str = "auto",
        probe_every: int = PROBE_EVERY,
    ) -> None:
        """`probe`: the fixed sequences; None draws them from the learner's vocabulary at the first refresh.
        `weight_sync` (resources.weight_sync): auto | host; `probe_every` (trainer.probe_every): see the module note."""
        if weight_sync not in WEIGHT_SYNC:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC}, got {weight_sync!r}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1 (1: probe every refresh), got {probe_every}")
        self.rollouts, self.learners = rollouts, learners
        self.weight_sync, self.probe_every = weight_sync, probe_every
        self.on_device: bool | None = None  # decided at the first refresh
        self.fixed = None if probe is None else [tuple(s) for s in probe]
        self.identity: PolicyIdentity | None = None  # what every replica provably serves now
        self.refreshes = 0  # publish-and-prove rounds so far
        self.probed = 0  # of them, those that ran the probe
        self.tolerances: list[float] = []  # per replica, read once
        self.by_digest: list[bool] | None = None  # per replica: reports a served digest (seen at the first refresh)
        self.noise: list[float] = []  # per replica: max gap of two probes of the same weights
        self.last_probe: dict[str, float] = {}  # what the last refresh measured (logged per step)
        self._recent: list[tuple[int, ...]] = []  # on-policy rows for the next probe
        self._carried: list[tuple[int, ...]] = []  # the rows the last probe scored, compared again
        # sequence -> (served log-probs per replica, learner log-probs) at the last probe
        self._previous: dict[tuple[int, ...], tuple[list[list[float]], list[float]]] = {}

    def learner_updated(self) -> None:
        """The learner applied an optimizer step: the served policy is now one version behind."""
        self.identity = None

    def remember(self, batch: RolloutBatch) -> None:
        """Add a few of this training batch's rows to the next probe."""
        self._recent = _probe_rows(batch, RECENT_ROWS)

    def ensure_served(self) -> PolicyIdentity:
        """The policy every replica serves, published and proven first unless it is already current."""
        if self.identity is None:
            self.identity = self._refresh()
        return self.identity

    def prove_trial_adapter(self) -> float:
        """Serve and prove a non-zero trial adapter (the gate, before v0 is served): at v0 lora_B is 0, so a
        replica that merges wrongly or drops the adapter term serves v0 exactly. The served digest and the gap
        test run on it now; the change test at the next refresh (v0 against the trial: the run's first refresh,
        which always probes), which then publishes the learner's real policy. Returns the max gap under the
        trial adapter as the gap test weighs it (served_policy.weighed_gap, nats)."""
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

    def _probe_due(self) -> bool:
        """The first refresh, every probe_every-th after it, and every refresh of a replica without a served
        digest (known from the first refresh, which probes anyway)."""
        return self.by_digest is None or not all(self.by_digest) or self.refreshes % self.probe_every == 0

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
        probing = trial or self._probe_due()
        sequences = self._sequences() if probing else []
        probe = [list(s) for s in sequences] or None
        first = probing and not self.noise  # the replicas' noise floor: the same weights probed twice
        learner, others = None, []
        if trial:
            snapshot = submit(self.learners[0], "trial_snapshot", TRIAL_SEED, TRIAL_STD)
            learner = submit(self.learners[0], "probe_logprobs_with", snapshot, probe)
        else:
            if probing:
                learner = submit(self.learners[0], "probe_logprobs", probe)
            snapshot = submit(self.learners[0], "publish_policy", True, self.on_device)
            others = [submit(rank, "publish_policy", False) for rank in self.learners[1:]]
        served_refs = [submit(r, "serve", snapshot, probe, 2 if first else 1) for r in self.rollouts]
        stages = [("publish", [snapshot, *others]), ("learner_probe", [learner] if probing else [])]
        timing = _stage_times(stages if trial else stages[::-1])  # in the order the learner runs them
        learner, *rest = fetch([learner, *others, *served_refs])
        others, served = rest[: len(others)], rest[len(others) :]
        timing |= _replica_times(served)
        identity = served[0].identity  # the name every replica received with the learner's snapshot
        for rank, other in enumerate(others, start=1):
            if other.identity != identity:
                raise PolicyMismatchError(
                    f"learner rank {rank} holds {other.identity.short()} but rank 0 published {identity.short()};"
                    " data-parallel ranks diverged, so the run stops"
                )
        self._check_names_and_digests(served, identity)
        probed = self._check_probes(served, learner, sequences, identity) if probing else {}
        self.refreshes += 0 if trial else 1
        self.probed += int(probing and not trial)
        self.last_probe = {"probe_ran": float(probing), **probed, **timing}
        return identity

    def _check_names_and_digests(self, served: list[ServedPolicy], identity: PolicyIdentity) -> None:
        """Every replica took the same snapshot and, where its engine reports one, serves the published adapter
        bit for bit (its served digest is the learner's)."""
        if self.by_digest is None:
            self.by_digest = [s.digest is not None for s in served]
        for i, s in enumerate(served):
            if s.identity != identity:
                raise PolicyMismatchError(
                    f"rollout replica {i} serves {s.identity.short()} but replica 0 serves {identity.short()} of the"
                    " same snapshot; a worker did not take the new snapshot, so the run stops"
                )
            if s.digest is None and self.by_digest[i]:
                raise PolicyMismatchError(
                    f"rollout replica {i} reported no digest of the adapter it serves for {identity.short()}, although"
                    " it did at the first refresh; this refresh ran no probe, so nothing proves what it serves and the"
                    " run stops. Its backend's served_digest must keep answering (or set trainer.probe_every=1)"
                )
            if s.digest is not None and s.digest != identity.digest:
                raise PolicyMismatchError(
                    f"rollout replica {i} serves an adapter whose digest ({s.digest.removeprefix(DIGEST_PREFIX)[:12]},"
                    f" read from its serving buffers) is not that of the published {identity.short()}: it kept its old"
                    " weights, loaded part of the new ones or altered them, so the run stops before this step. Check"
                    " the replica's weight sync"
                )

    def _check_probes(
        self, served: list[ServedPolicy], learner: list[list[float]], sequences: list[tuple[int, ...]], identity
    ) -> dict[str, float]:
        """The gap and change tests of this refresh's probe, each replica on its own; returns the metrics."""
        if not self.noise:  # the replica's own noise floor: the same weights probed twice
            self.noise = [max_gap(s.probes[0], s.probes[1]) for s in served]
        common = [j for j, s in enumerate(sequences) if s in self._previous]
        gaps, served_moved, learner_moved = [], [], 0.0
        if common:
            learner_moved = max_gap([learner[j] for j in common], [self._previous[sequences[j]][1] for j in common])
        for i, s in enumerate(served):
            probe_i = s.probes[0]
            gaps.append(check_gap(i, identity.version, probe_i, learner, self.tolerances[i]))
            if common:
                now = [probe_i[j] for j in common]
                before = [self._previous[sequences[j]][0][i] for j in common]
                served_moved.append(max_gap(now, before))
                check_changed(i, identity.version, served_moved[-1], learner_moved, self.noise[i])
        self._previous = {q: ([s.probes[0][j] for s in served], learner[j]) for j, q in enumerate(sequences)}
        self._carried, self._recent = self._recent, []
        # what the change test weighed (nats): the learner's move, the least any replica's served probe moved, and
        # the largest replica noise floor (a logged run shows the test was armed: learner_moved above the noise)
        return {
            "probe_gap_max": max(gaps),
            "probe_learner_moved": learner_moved,
            "probe_served_moved": min(served_moved, default=0.0),
            "probe_noise": max(self.noise),
        }


def _replica_times(served: list[ServedPolicy]) -> dict[str, float]:
    """The replicas' own split of their `serve` call (`time/refresh/<part>`: load, served_digest, served_probe),
    the slowest replica's for each part, on the replicas' clocks."""
    return {f"time/refresh/{part}": max(s.seconds[part] for s in served) for part in served[0].seconds}


def _stage_times(stages: list[tuple[str, list[Any]]]) -> dict[str, float]:
    """Seconds each learner stage took, as the driver sees them end (`time/refresh/<stage>`): the learner runs
    them one after the other, so waiting for each in turn splits its work without fetching anything. A stage
    with nothing to wait for reads ~0. In-process every stage has already run: all read ~0."""
    out, last = {}, time.perf_counter()
    for name, handles in stages:
        settle(handles)
        now = time.perf_counter()
        out[f"time/refresh/{name}"], last = now - last, now
    return out
