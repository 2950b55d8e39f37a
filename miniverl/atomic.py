"""Write a file or a directory all at once: into a hidden sibling, renamed into place only when complete.

The one way miniverl publishes what it writes (checkpoints, built-in models, vLLM's adapter folders, the
bridge's exports, metrics files trimmed on resume): a crash, an error or a kill while writing leaves the
old file or folder as it was, never a half-written one, and at most a `*.partial` sibling behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_SUFFIX = ".partial"  # a sibling being written; never read as the thing itself
_DIR_MODE = 0o777
_FILE_MODE = 0o666


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_tree(root: Path) -> None:
    """Flush file contents before the rename publishes them (a power loss must not expose empty files)."""
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())


@contextmanager
def atomic_dir(out: str | Path, fsync: bool = False, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a new hidden directory next to `out`; rename it to `out` if the block succeeds, delete it if not.

    `fsync` flushes every file before the rename. When `out` exists by the time the block ends, nothing is
    overwritten: FileExistsError (callers that refuse with their own message check before they start), or
    with `keep_existing` (another writer of the same thing finished first) its copy is kept and ours dropped. Each call
    gets its own sibling, so two processes writing the same `out` never mix their files.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Same parent, so the final rename stays on one filesystem (atomic on POSIX).
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=PARTIAL_SUFFIX, dir=out.parent))
    try:
        tmp.chmod(_DIR_MODE & ~_umask())  # mkdtemp makes it private; the result is an ordinary directory
        yield tmp
        if fsync:
            _fsync_tree(tmp)
        if out.exists() and keep_existing:
            shutil.rmtree(tmp)
        elif out.exists():  # os.rename would silently replace an empty directory
            raise FileExistsError(f"{out} already exists: not overwritten")
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace the file `path` with `text` in one step: readers see the old contents or the new, never a part."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(name, _FILE_MODE & ~_umask())  # mkstemp makes it private; the result is an ordinary file
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
