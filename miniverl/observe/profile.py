"""One call of an actor under torch's profiler, where it runs: a diagnostic, off by default.

MINIVERL_PROFILE_CALL=K (0 or unset: off) profiles the K-th `score` of every teacher and the K-th `update` of every
learner rank, and writes their operators by device time and by CPU time to
MINIVERL_PROFILE_DIR/<actor>-call<K>-pid<pid>.txt. A learner updates once a step: its K-th update is step K's. A
teacher also scores each evaluation's samples (trainer.eval_every, step 0's included), so with the evaluation at step
0 its K-th call is step K-1's: pick K past the first steps (the compiled learner compiles in its first). The
directory is required with K and made if missing; Ray actors inherit both from the driver's environment, which
refuses bad values before Ray starts (`profile_request`). The profiled call runs slower than the others (the
profiler records every operator): its step's times are not the run's. In a colocated process (resources.colocate)
the profile also holds what the other roles ran on their threads meanwhile.

Why: lab/results/peers.md (2026-12-06, 3d6a8c6) measured the scorer 0.7 s a step slower end to end than alone at the
same rows, and the learner's update 2.6x a row token what it costs at rows that never stop; the benches profile the
actors alone, which is what differs.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from miniverl.errors import ConfigError

PROFILE_CALL_ENV = "MINIVERL_PROFILE_CALL"
PROFILE_DIR_ENV = "MINIVERL_PROFILE_DIR"


def profile_request() -> tuple[int, Path] | None:
    """(K, directory) when MINIVERL_PROFILE_CALL asks for a profile, else None; a value that is not a whole number
    >= 0, or K without MINIVERL_PROFILE_DIR, is refused with the fix."""
    value = os.environ.get(PROFILE_CALL_ENV, "0").strip() or "0"
    try:
        call = int(value)
    except ValueError:
        call = -1
    if call < 0:
        raise ConfigError(
            f"{PROFILE_CALL_ENV}={value!r}: set it to the call to profile (1 = the first step's) or 0 (off)"
        )
    if call == 0:
        return None
    directory = os.environ.get(PROFILE_DIR_ENV, "").strip()
    if not directory:
        raise ConfigError(
            f"{PROFILE_CALL_ENV}={call} needs {PROFILE_DIR_ENV}: set it to the directory the profiles go to"
        )
    return call, Path(directory)


def write_profile(prof, path: Path, cuda: bool) -> None:
    """A finished torch profile's operators to `path`: the top 40 by device time (CPU time without CUDA), then the
    top 25 by self CPU time (what the Python and the launches cost)."""
    table = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        table.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40)
        + "\n\nby self cpu time:\n"
        + table.table(sort_by="self_cpu_time_total", row_limit=25)
    )


@contextmanager
def profiling(cuda: bool):
    """torch's profiler over the block: CPU activity and, with `cuda`, the GPU's, whose work is waited for before the
    profile stops. Yields the profile (its tables once the block has ended)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield prof
        if cuda:
            torch.cuda.synchronize()


def profiled(method):
    """An actor method whose calls `self.profile` (a CallProfile) counts, and profiles the one it was asked for."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.profile():
            return method(self, *args, **kwargs)

    return call


class CallProfile:
    """Counts an actor method's calls and profiles the one MINIVERL_PROFILE_CALL names (read once, at construction).

    Usage: `@profiled` on the method, `self.profile = CallProfile(...)` in the actor's constructor."""

    def __init__(self, actor: str, device: str) -> None:
        self.actor = actor
        self.cuda = device == "cuda"
        self.request = profile_request()
        self.calls = 0
        self.written: Path | None = None

    @contextmanager
    def __call__(self):
        self.calls += 1
        if self.request is None or self.calls != self.request[0]:
            yield
            return
        with profiling(self.cuda) as prof:
            yield
        path = self.request[1] / f"{self.actor}-call{self.calls}-pid{os.getpid()}.txt"
        copies = 1
        while path.exists():  # two teachers of one process whose directories share a name: both kept
            copies += 1
            path = path.with_name(f"{self.actor}-call{self.calls}-pid{os.getpid()}-{copies}.txt")
        write_profile(prof, path, self.cuda)
        self.written = path
        print(f"{self.actor}: call {self.calls} profiled ({PROFILE_CALL_ENV}) into {path}", flush=True)
