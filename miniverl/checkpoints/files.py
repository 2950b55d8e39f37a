"""One checkpoint directory: adapter (peft format), optimizer, RNG states and state.json, written atomically.

Layout of `step_<k>/`:
  adapter/         peft `save_pretrained` output
  optimizer.pt     the optimizer's state_dict
  rng.pt           torch (CPU and CUDA), python and numpy RNG states of the learner process
  state.json       step, policy version and digest, config hash, miniverl version, the config, and the
                   SHA-256 of every file above (so a truncated or edited file is detected on resume)
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch

from miniverl.atomic import atomic_dir
from miniverl.errors import MiniVerlError, disk_full
from miniverl.policy import PolicyIdentity

STATE_FILE = "state.json"
ADAPTER_WEIGHTS = "adapter/adapter_model.safetensors"  # the adapter's tensors as peft's save_pretrained wrote them
HASH_CHUNK_BYTES = 1 << 20


class CheckpointError(MiniVerlError):
    """A checkpoint could not be written, or one on disk cannot be used.

    `reason` is what is wrong without the fix the message ends with, for a caller that acts on it itself (resume
    moves an unusable checkpoint aside and says why, store.set_aside)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


def unusable(reason: str, fix: str = "resume from an older checkpoint") -> CheckpointError:
    """The error for a checkpoint on disk that cannot be used: `reason`, then the fix."""
    return CheckpointError(f"{reason}; {fix}", reason)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_checkpoint(directory: Path, model, optimizer, identity: PolicyIdentity, meta: dict[str, Any]) -> Path:
    """Write the checkpoint to `directory`; never overwrites one, never leaves a half-written one.

    Files go to a hidden `*.partial` sibling first (miniverl/atomic.py), renamed into place only when every
    file is written and flushed: a crash, a full disk or a kill mid-write leaves the previous checkpoints as they
    were. `meta` (step, config, ...) is stored in state.json as given.
    """
    if directory.exists():
        raise CheckpointError(f"checkpoint {directory} already exists; refusing to overwrite it (move it away first)")
    tmp = directory  # named in the error when the temporary folder was never made
    try:
        with atomic_dir(directory, fsync=True) as tmp:
            try:
                write_files(tmp, model, optimizer, identity, meta)
            except Exception as e:  # judged here, while the half-written files still fill the disk
                full = disk_full(e, directory, "continue with trainer.resume=auto: the previous checkpoints are intact")
                if full is not None:
                    raise CheckpointError(str(full)) from e
                raise
    except OSError as e:
        raise CheckpointError(
            f"could not write checkpoint {directory}: {e.strerror or e} ({e.__class__.__name__}, at"
            f" {e.filename or tmp}); the previous checkpoints are untouched. Free disk space or make the run"
            " directory writable, then resume with trainer.resume=auto"
        ) from e
    return directory


def write_files(tmp: Path, model, optimizer, identity: PolicyIdentity, meta: dict[str, Any]) -> None:
    """The checkpoint's files, and state.json with every file's digest, into the folder `tmp`."""
    model.save_pretrained(str(tmp / "adapter"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    files = {str(p.relative_to(tmp)): file_digest(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    state = {**meta, "policy_version": identity.version, "policy_digest": identity.digest, "files": files}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))


def read_state(directory: Path) -> dict[str, Any]:
    """state.json of a checkpoint after checking that every file it lists is present and unchanged."""
    path = directory / STATE_FILE
    if not path.is_file():
        raise unusable(f"{directory} is not a miniVERL checkpoint (no {STATE_FILE})", "point at a step_<k> folder")
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise unusable(f"{path} is corrupt ({e})") from e
    for name, digest in state.get("files", {}).items():
        f = directory / name
        if not f.is_file():
            raise unusable(f"checkpoint {directory} is missing {name}")
        if file_digest(f) != digest:
            raise unusable(
                f"checkpoint {directory} is corrupt: {name} does not match the SHA-256 recorded when it was written"
            )
    return state
