"""Which policy a component holds: its identity (version and weights digest) and what the learner publishes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyIdentity:
    """Which policy a component holds: a monotonic version and a digest of the trainable weights."""

    version: int
    digest: str

    def short(self) -> str:
        return f"v{self.version}:{self.digest[:12]}"


@dataclass
class PolicySnapshot:
    """What the learner publishes: its identity and the trainable weights (CPU tensors)."""

    identity: PolicyIdentity
    weights: dict[str, torch.Tensor]


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over sorted names, dtypes, shapes and raw bytes of `weights`.

    The policy's name, computed only by the learner (when it publishes, saves or restores a checkpoint;
    never by a rollout engine). It proves nothing about what a rollout engine serves (merged or fused
    copies, the base model): the strict-sync probe does that (miniverl/step/served_policy.py).
    """
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # the buffer itself: no bytes copy
    return h.hexdigest()
