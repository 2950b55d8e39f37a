"""Checkpoints inside a run directory: naming, finding the newest valid one, setting unusable ones aside,
keeping the last few."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from miniverl.atomic import PARTIAL_SUFFIX
from miniverl.checkpoints.files import CheckpointError, read_state, unusable

CHECKPOINTS_DIR = "checkpoints"
STEP_PATTERN = re.compile(r"^step_(\d+)$")
# An unusable checkpoint moved out of a resumed run's way: `step_<k>.corrupt` (then `.corrupt.2`, ...). Kept for
# the user, never deleted; STEP_PATTERN does not match it, so no listing, resume or prune ever reads it.
SET_ASIDE_SUFFIX = ".corrupt"
REQUIRED_STATE_KEYS = ("step", "policy_version", "policy_digest", "config", "config_hash", "first_eval", "files")
# What marks a directory as holding a run (.hydra/ alone does not: main writes it once the checks pass, so a
# run stopped while its actors started leaves only .hydra/, and nothing was trained).
RUN_MARKERS = ("metrics.jsonl", "summary.json", CHECKPOINTS_DIR)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS_DIR / f"step_{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoint folders, oldest first (partial writes and set-aside ones are skipped)."""
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_PATTERN.match(p.name).group(1)))


def load_valid_state(directory: Path) -> dict:
    state = read_state(directory)
    missing = [k for k in REQUIRED_STATE_KEYS if k not in state]
    if missing:
        raise unusable(f"checkpoint {directory} lacks {', '.join(missing)} in state.json", "it is not usable")
    return state


@dataclass(frozen=True)
class Unusable:
    """A checkpoint folder that fails its integrity check, and the error that says why."""

    path: Path
    error: CheckpointError


def check(path: Path) -> Unusable | None:
    """None when the checkpoint at `path` passes its integrity check (load_valid_state), else why not."""
    try:
        load_valid_state(path)
    except CheckpointError as e:
        return Unusable(path, e)
    return None


def scan(run_dir: Path) -> tuple[Path | None, list[Unusable]]:
    """(the newest checkpoint that passes its integrity check or None, the newer ones that fail it, newest first)."""
    skipped = []
    for path in reversed(list_checkpoints(run_dir)):
        bad = check(path)
        if bad is None:
            return path, skipped
        skipped.append(bad)
    return None, skipped


def newest_valid(run_dir: Path, log=print) -> Path | None:
    """The newest checkpoint that passes its integrity check; corrupt newer ones are named and skipped."""
    path, skipped = scan(run_dir)
    for bad in skipped:
        log(f"[miniverl] skipping a checkpoint that cannot be used: {bad.error}")
    return path


def set_aside(path: Path) -> Path:
    """Rename the checkpoint folder `path` to the first free `<name>.corrupt[.<n>]` beside it; returns the new path.

    One rename inside one folder: atomic, the folder is whole where it was or whole where it went, and its files
    are not touched. Raises CheckpointError naming the folder and the fix when the rename fails (a read-only run
    directory). Two resumes of one run directory at once are not supported, so the free name is not reserved.
    """
    target = path.with_name(path.name + SET_ASIDE_SUFFIX)
    copies = 1
    while target.exists():  # os.rename would replace an empty folder of that name silently
        copies += 1
        target = path.with_name(f"{path.name}{SET_ASIDE_SUFFIX}.{copies}")
    try:
        path.rename(target)
    except OSError as e:
        raise CheckpointError(
            f"could not move the unusable checkpoint {path} aside to {target.name} ({e.strerror or e}), and it"
            f" blocks the resumed run from saving that step; make {path.parent} writable, or move {path.name} out"
            " of it yourself, then resume again"
        ) from e
    return target


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
