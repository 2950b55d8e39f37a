"""Write an output directory all at once: into a hidden sibling, renamed into place only when complete."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from miniverl.errors import ConfigError

_DIR_MODE = 0o777


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def refuse_existing(out: str | Path) -> None:
    """The bridge never writes over something already there (it would lose it)."""
    if Path(out).exists():
        raise ConfigError(f"{out} already exists; the bridge never overwrites: pass a new --out or remove it first")


@contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; rename it to `out` if the block succeeds, delete it if not.

    A crash or error in the block leaves neither `out` nor a partial directory behind.
    """
    out = Path(out)
    refuse_existing(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Same parent, so the final rename stays on one filesystem (atomic on POSIX).
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        tmp.chmod(_DIR_MODE & ~_umask())  # mkdtemp makes it private; the result is an ordinary directory
        yield tmp
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
