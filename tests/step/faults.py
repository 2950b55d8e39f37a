"""Rollout replicas that fail strict sync in ways a real engine does, for the fault-injection tests and
lab/measurements/sampler_gap_faults.py. Each acknowledges every snapshot under its published name."""

from __future__ import annotations

from miniverl.workers.rollout import RolloutWorker


class StaleSamplingWorker(RolloutWorker):
    """Loads every snapshot into its serving buffers (its served digest and its probe are current) but samples with
    the adapter it held at its first generate call: the generation path kept an older policy (a prefix or KV cache
    reused across weight updates, a graph captured once and bound to stale buffers, an engine copy never
    refreshed). Its first generate call (the conformance gate's, at v0) is honest."""

    sampling: dict | None = None

    def load_policy(self, snapshot):
        identity = super().load_policy(snapshot)
        self.current = {k: v.clone() for k, v in snapshot.tensors().items()}
        return identity

    def generate(self, prompts, params, first_row: int = 0):
        if self.sampling is None:
            self.sampling = self.current
        self.backend.load_adapter(self.sampling)
        try:
            return super().generate(prompts, params, first_row)
        finally:
            self.backend.load_adapter(self.current)
