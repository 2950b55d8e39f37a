"""Checkpoints inside a run directory: naming, finding the newest valid one, keeping the last few."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from miniverl.atomic import PARTIAL_SUFFIX
from miniverl.checkpoints.files import CheckpointError, read_state

CHECKPOINTS_DIR = "checkpoints"
STEP_PATTERN = re.compile(r"^step_(\d+)$")
REQUIRED_STATE_KEYS = ("step", "policy_version", "policy_digest", "config", "config_hash", "first_eval", "files")
# What marks a directory as holding a run (.hydra/ alone does not: main writes it once the checks pass, so a
# run stopped while its actors started leaves only .hydra/, and nothing was trained).
RUN_MARKERS = ("metrics.jsonl", "summary.json", CHECKPOINTS_DIR)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS_DIR / f"step_{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoint folders, oldest first (partial writes are skipped)."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_PATTERN.match(p.name).group(1)))


def load_valid_state(directory: Path) -> dict:
    state = read_state(directory)
    missing = [k for k in REQUIRED_STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {directory} lacks {', '.join(missing)} in state.json; it is not usable")
    return state


def newest_valid(run_dir: Path, log=print) -> Path | None:
    """The newest checkpoint that passes its integrity check; corrupt newer ones are named and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            load_valid_state(path)
        except CheckpointError as e:
            log(f"[miniverl] skipping a checkpoint that cannot be used: {e}")
            continue
        return path
    return None


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints, and leftovers of interrupted writes; returns what went."""
    done = list_checkpoints(run_dir)
    gone = done[: max(0, len(done) - keep)]
    root = run_dir / CHECKPOINTS_DIR
    gone += [p for p in root.glob(f"*{PARTIAL_SUFFIX}")] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def holds_run(run_dir: Path) -> list[str]:
    """The files that show `run_dir` already holds a run (empty when it is fresh)."""
    return [m for m in RUN_MARKERS if (run_dir / m).exists()]
