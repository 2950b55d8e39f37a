"""Checkpoints: the adapter (peft format), the optimizer state and the step, written atomically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from miniverl.protocol import MiniVerlError, PolicyIdentity


def save_checkpoint(directory: Path, model, optimizer, identity: PolicyIdentity) -> Path:
    """Write `directory/{adapter/, optimizer.pt, state.json}`; never overwrites an existing checkpoint.

    Files go to a sibling temporary folder first and are renamed into place at the end, so an
    interrupted save leaves no half-written checkpoint under the final name.
    """
    if directory.exists():
        raise MiniVerlError(f"checkpoint {directory} already exists; refusing to overwrite it (move it away first)")
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp / "adapter"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    state = {"step": identity.version, "policy_version": identity.version, "policy_digest": identity.digest}
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    tmp.rename(directory)
    return directory


def load_checkpoint_state(directory: str | Path) -> dict:
    """The step and policy identity a checkpoint recorded."""
    path = Path(directory) / "state.json"
    if not path.exists():
        raise MiniVerlError(f"{directory} is not a miniVERL checkpoint (no state.json)")
    return json.loads(path.read_text())
