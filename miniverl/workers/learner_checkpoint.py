"""The learner's checkpoint: its training state written, read back, and proven against the digest it recorded.

What one checkpoint directory holds, and its atomic write, are checkpoints/files.py's; here the learner's adapter,
optimizer and RNG states go in and come back, a poisoned adapter is never written, and a restored adapter must hash
to the recorded digest. The learner (workers/learner.py) keeps the policy version these carry.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miniverl.checkpoints.files import ADAPTER_WEIGHTS, CheckpointError, read_state, set_rng_state, write_checkpoint
from miniverl.errors import NonFiniteError
from miniverl.models.lora import adapter_state, live_adapter, load_adapter_state
from miniverl.policy import PolicyIdentity, digest_matches, weights_digest

if TYPE_CHECKING:
    from peft import PeftModel


def save_learner(
    directory: str, model: PeftModel, optimizer: torch.optim.Optimizer, version: int, meta: dict | None
) -> str:
    """Write adapter, optimizer, RNG states and `meta` (step, config) atomically under policy `version`; refuses a
    poisoned adapter. Returns the checkpoint's path."""
    weights = adapter_state(model)
    bad = [k for k, v in weights.items() if not torch.isfinite(v).all()]
    if bad:
        raise NonFiniteError(
            f"the adapter holds NaN/inf values ({bad[0]} and {len(bad) - 1} more); refusing to save it over"
            " the last good checkpoint. Resume from that one with trainer.resume=auto and a lower trainer.lr"
        )
    identity = PolicyIdentity(version, weights_digest(live_adapter(model)))
    meta = {"step": version, **(meta or {})}
    return str(write_checkpoint(Path(directory), model, optimizer, identity, meta))


def restore_learner(directory: str, model: PeftModel, optimizer: torch.optim.Optimizer, device: str) -> dict[str, Any]:
    """Load adapter, optimizer and RNG states from the checkpoint in `directory`; returns its state.json (the
    policy version and digest it recorded: `check_restored` holds the adapter to that digest)."""
    from safetensors.torch import load_file

    path = Path(directory)
    state = read_state(path)
    load_adapter_state(model, load_file(str(path / ADAPTER_WEIGHTS)))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return state


def check_restored(directory: str, model: PeftModel, version: int, recorded: str) -> PolicyIdentity:
    """The restored policy's identity (`version` and its adapter's digest); CheckpointError unless the adapter
    hashes to the digest the checkpoint `recorded`."""
    live = live_adapter(model)
    restored = PolicyIdentity(version, weights_digest(live))
    if not digest_matches(live, recorded, restored.digest):
        raise CheckpointError(
            f"the adapter restored from {directory} hashes to {restored.short()} but the checkpoint recorded"
            f" {recorded[:12]}; the checkpoint is corrupt, resume from an older one"
        )
    return restored
