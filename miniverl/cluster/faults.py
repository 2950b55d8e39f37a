"""How a run stops on a signal or a dead actor: named, with the last checkpoint intact."""

from __future__ import annotations

import errno
import os
import select
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from miniverl.errors import MiniVerlError

SIGNAL_EXIT_BASE = 128  # shell convention: a process ended by signal N exits with 128 + N (130 = Ctrl-C)


class RunInterrupted(MiniVerlError):
    """SIGINT/SIGTERM arrived; the last completed step was checkpointed and the actors were stopped."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = SIGNAL_EXIT_BASE + signum


class ActorDiedError(MiniVerlError):
    """An actor process died mid-run (killed, out of memory, crashed)."""


class OutputClosed:
    """Whether the driver's stdout/stderr lost their reader (`... | tee log` and tee died, often from the same
    Ctrl-C). Python ignores SIGPIPE, so the next print would raise BrokenPipeError and end the run with no
    checkpoint; `guard_output` turns that into a stop request (exit 141, 128 + SIGPIPE) instead."""

    closed = False

    @classmethod
    def check(cls) -> bool:
        """True once a write failed, or when a pipe on fd 1 or 2 has no reader left (poll says POLLERR)."""
        if not cls.closed:
            for fd in (1, 2):
                if _reader_gone(fd):
                    _to_devnull(fd)
                    cls.closed = True
        return cls.closed


def _reader_gone(fd: int) -> bool:
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def _to_devnull(fd: int) -> None:
    """Later writes to `fd` go nowhere instead of failing (the run still writes its files)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class _GuardedStream:
    """A text stream whose writes survive a closed pipe: the first EPIPE redirects its fd to /dev/null and
    marks the output closed."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _guard(self, method: str, *args):
        try:
            return getattr(self._stream, method)(*args)
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
            _to_devnull(self._stream.fileno())
            OutputClosed.closed = True
            return getattr(self._stream, method)(*args)  # the buffered text now goes to /dev/null

    def write(self, text: str) -> int:
        return self._guard("write", text)

    def flush(self) -> None:
        self._guard("flush")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_output() -> None:
    """Wrap sys.stdout and sys.stderr (main calls it; tqdm, print and Ray's log forwarding all write there)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _GuardedStream):
            setattr(sys, name, _GuardedStream(stream))


@contextmanager
def shielded_children() -> Iterator[None]:
    """Processes started inside (Ray's raylet, GCS and dashboard: they stay in the driver's process group) start
    with SIGINT and SIGTERM blocked, so a signal to the whole group (a terminal's Ctrl-C, `timeout`, a scheduler)
    leaves them running while the driver checkpoints; measured: a group SIGTERM killed the raylet and with it
    the actors. ray.shutdown still stops them (SIGKILL after Ray's one-second grace)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(StopRequests.SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class StartupInterrupted(BaseException):
    """SIGINT/SIGTERM before the first step (models loading, actors starting): nothing to checkpoint yet."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = SIGNAL_EXIT_BASE + signum


class StartupSignals:
    """Until the loop's StopRequests take over, SIGINT and SIGTERM raise StartupInterrupted in the main thread,
    so `finally` blocks stop Ray and the actors and main prints one line (not a KeyboardInterrupt traceback)."""

    def __enter__(self) -> StartupSignals:
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in StopRequests.SIGNALS:
                self._previous[s] = signal.signal(s, self._raise)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    @staticmethod
    def _raise(signum: int, _frame: object) -> None:
        raise StartupInterrupted(signum)


class StopRequests:
    """While active, SIGINT and SIGTERM ask the run to stop after the current step instead of killing it,
    and so does a closed output pipe (OutputClosed).

    A second signal stops at once (KeyboardInterrupt), for a step that hangs. Handlers can only be set in
    the main thread; elsewhere (a run started from a thread) signals keep their default behaviour.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.signum = signum
        print(
            f"\n[miniverl] {signal.Signals(signum).name}: finishing the current step, then checkpointing and"
            " stopping (send it again to stop at once)",
            flush=True,
        )

    @property
    def requested(self) -> bool:
        if self.signum is None and OutputClosed.check():
            self.signum = signal.SIGPIPE
        return self.signum is not None


def actor_names(actors: dict[str, list[Any]]) -> dict[str, str]:
    """Ray actor id (hex) -> 'rollout replica 0' etc., to name the actor in a RayActorError."""
    from miniverl.cluster.colocate import RoleHandle, actor_handle

    out = {}
    for role, group in actors.items():
        for i, actor in enumerate(group):
            actor_id = getattr(actor_handle(actor), "_actor_id", None)
            if actor_id is not None:
                colocated = isinstance(actor, RoleHandle)
                out[actor_id.hex()] = "colocated (rollout, scorer, learner)" if colocated else f"{role} replica {i}"
    return out


def dead_actor_error(error: Exception, names: dict[str, str], step: int, checkpoint: str | None) -> ActorDiedError:
    who = names.get(getattr(error, "actor_id", None) or "", "an actor")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else error.__class__.__name__
    resume = (
        f"the last checkpoint {checkpoint} is intact; continue with trainer.resume=auto"
        if checkpoint
        else "no checkpoint was written yet (trainer.save_every sets how often); rerun from the start"
    )
    return ActorDiedError(f"the {who} actor died during step {step} ({first_line}); {resume}")
