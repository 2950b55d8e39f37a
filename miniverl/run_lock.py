"""One run per directory: an exclusive lock on `<run dir>/.miniverl.lock`, held for the whole run.

Two runs started in one directory seconds apart both passed the "already holds a run" check (nothing was written
yet), both trained, and metrics.jsonl interleaved their steps (issue 76). The lock is taken before anything of the
run is read or written, so the second run is refused in one line naming the first one's pid.

The lock is `fcntl.flock` on the file, which the kernel releases when its holder dies however it dies (SIGKILL, a
machine taken back), so a lock is never stale by itself; the file may be, and it says whose it was. The holder
writes its pid and start time into it: a refusal names the running run, a take-over names the dead one. The file is
removed on release (after its inode was checked, so two runs never hold locks on two inodes of one name), and a
directory the lock itself had to make is removed again if the run left it empty: a refused run leaves the
directory as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from types import TracebackType

from miniverl.errors import ConfigError

LOCK_FILE = ".miniverl.lock"


class RunLock:
    """`with RunLock(run_dir, log):` holds the run directory for the block. Raises ConfigError when another
    process holds it, naming that process's pid and start time and the fix."""

    def __init__(self, run_dir: Path, log=print) -> None:
        self.run_dir, self.path, self.log = Path(run_dir), Path(run_dir) / LOCK_FILE, log
        self._fd: int | None = None
        self._made_dir = False

    def __enter__(self) -> RunLock:
        self._made_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = read_holder(fd)
                os.close(fd)
                self._remove_made_dir()
                raise ConfigError(
                    f"the run directory {self.run_dir} is in use by another miniverl run ({describe(holder)}); wait"
                    f" for it to end or stop it{stop_hint(holder)}, or pick another directory (hydra.run.dir=...)"
                ) from None
            if same_file(fd, self.path):
                break
            os.close(fd)  # the holder released and removed the file between our open and our lock: open it again
        earlier = read_holder(fd)
        if earlier:  # flock was free, so whoever wrote this is gone without releasing (killed)
            self.log(
                f"[miniverl] {self.path} named a run that ended without releasing it ({describe(earlier)}): no"
                " process holds it, so this run takes it over"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_record()).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: no other run has it open under this name
        finally:
            os.close(self._fd)
            self._fd = None
        self._remove_made_dir()

    def _remove_made_dir(self) -> None:
        if self._made_dir:
            with contextlib.suppress(OSError):  # only when empty: a run that wrote anything keeps its directory
                self.run_dir.rmdir()


def holder_record() -> dict:
    """What the holder writes into the lock file: its pid, start time and host (a shared filesystem)."""
    return {"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": os.uname().nodename}


def read_holder(fd: int) -> dict:
    """The lock file's record, or {} when it is empty (a holder that has not written it yet) or unreadable."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        record = json.loads(text) if text.strip() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def describe(holder: dict) -> str:
    if "pid" not in holder:
        return "pid not yet written: it started a moment ago"
    host = f" on {holder['host']}" if holder.get("host") not in (None, os.uname().nodename) else ""
    return f"pid {holder['pid']}{host}, started {holder.get('started', 'at an unknown time')}"


def stop_hint(holder: dict) -> str:
    if "pid" not in holder or holder.get("host") not in (None, os.uname().nodename):
        return ""
    return f" (Ctrl-C in its terminal, or kill {holder['pid']}: it checkpoints and exits)"


def same_file(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path`."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
        return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
    except FileNotFoundError:
        return False
