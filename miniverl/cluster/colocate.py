"""resources.colocate: the rollout replica, the scorer and the learner of one GPU in ONE actor process.

Separate actor processes share a GPU by time-slicing: their kernels never run at once, so overlapping the next
rollout with the update (trainer.staleness=1) bought 0.97x on an H200 (lab/results/staleness-gpu.md). In one
process each role computes on its own CUDA stream and Ray runs each role's calls on its own thread (one
concurrency group per role), so a rollout's decode kernels can run beside the learner's update; and the process
pays one CUDA context instead of three.

The controller is unchanged: each role is handed a RoleHandle, which turns `handle.method` into the colocated
actor's `role__method`, so submit/call/fetch (cluster/actors.py) work as with three actors.

Measured on an H200 at the 4080 recipe (lab/results/staleness-gpu.md, 2026-12-02, 3462f53): strict, 7.14 s per step
against 7.66 with separate actors and a whole-GPU peak 1.1 GiB lower; with trainer.staleness=1, 5.68 s (1.35x the
separate strict run; 0.97x with separate processes). Its costs: the roles share the SMs and one Python interpreter
(the learner's update is partly CPU-bound, and beside the rollout's decode loop it went 2.44 -> 4.00 s;
resources.switch_interval_ms sets how long a role waits for another's Python, ProcessSettings.switch_interval_s),
and hf_cached captures a CUDA graph for each new decode width, which synchronizes the device and empties the
allocator's cache (torch.cuda.graph): with trainer.staleness=1 the first rollout's captures run beside an update.
CUDA_CAPTURE_LOCK (miniverl/process.py) keeps the learner's cache release out of a capture; an update that runs out of
memory during one is redone smaller (`micro_batch_tokens` in the metrics shows it). A compiled learner
(trainer.compile_layers) holds that lock through each of its calls, since Inductor compiles, and synchronizes the
device, at whichever call first meets a new shape: a capture waits for the call (the first steps' new decode widths
only; replays take no lock), and the call waits for a capture.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from miniverl.process import CUDA_CAPTURE_LOCK, ProcessSettings, setup_process

ROLES = ("rollout", "scorer", "learner")  # built in this order: the rollout claims its memory first


class RoleHandle:
    """One role of a colocated actor, called like that role's own actor handle."""

    def __init__(self, handle: Any, role: str) -> None:
        self.handle, self.role = handle, role

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # Ray's own members (__ray_ready__) and Python's belong to the whole actor
            raise AttributeError(name)
        return getattr(self.handle, f"{self.role}__{name}")

    def __repr__(self) -> str:
        return f"RoleHandle({self.role} of {self.handle!r})"


def actor_handle(actor: Any) -> Any:
    """The Ray actor behind a handle or a RoleHandle (to wait for it, name it or kill it)."""
    return actor.handle if isinstance(actor, RoleHandle) else actor


def colocated_class(parts: dict[str, type]) -> type:
    """A class whose instance holds one object of each `parts[role]` and exposes each public method `name` of that
    role's class as `role__name`, run on the role's CUDA stream. remote_actor (cluster/actors.py) puts each
    `role__*` method in the role's concurrency group, so different roles' calls can run at once."""
    unknown = set(parts) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}; colocated roles are {ROLES}")
    members: dict[str, Any] = {"__init__": _init, "__module__": __name__, "__qualname__": "Colocated"}
    for role, cls in parts.items():
        for name, _ in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_"):
                members[f"{role}__{name}"] = _forwarder(role, name)
    return type("Colocated", (), members)


def processes(actors: dict[str, list[Any]]) -> dict[str, Any]:
    """One handle per actor process, named for what it holds: `rollout`, `scorer0`, ... or `colocated` (whose
    memory peaks are its roles' together: asking each role would count them three times)."""
    out: dict[str, Any] = {}
    for role, group in sorted(actors.items(), key=lambda item: item[0] == "scorer"):  # a learner keeps its name
        for i, actor in enumerate(group):
            if isinstance(actor, RoleHandle):
                out.setdefault("colocated", actor)
            elif not any(actor is seen for seen in out.values()):  # learners that also score (teacher self): once
                out[role if len(group) == 1 else f"{role}{i}"] = actor
    return out


def _init(self, specs: dict[str, tuple[type, tuple, dict]], process: ProcessSettings) -> None:
    """`specs[role]` = (class, args, kwargs) as each role's own actor would be built; `process`: this process's
    settings, its memory cap the sum of the roles' (their own settings carry their shares for sizing only). Each
    role is built on its own stream: the caching allocator reuses a freed block only on the stream it came from."""
    self.device = setup_process(process)
    roles = [role for role in ROLES if role in specs]
    self.streams = {role: torch.cuda.Stream() for role in roles} if self.device == "cuda" else {}
    self.parts = {}
    for role in roles:
        cls, args, kwargs = specs[role]
        self.parts[role] = _on_stream(self.streams.get(role), cls, *args, **kwargs)


def _on_stream(stream, fn, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on `stream` (None: as is), finished when it returns: its result is safe for any role."""
    if stream is None:
        return fn(*args, **kwargs)
    with torch.cuda.stream(stream):
        out = fn(*args, **kwargs)
    stream.synchronize()  # this stream only: the other roles' work runs on
    return out


def _run_role(host: Any, role: str, name: str, *args: Any, **kwargs: Any) -> Any:
    """`role`'s method `name` on its stream. A compiled learner may compile (and synchronize the device) in any call
    that meets a new shape, and a capture of the rollout's decode graph on another thread must not run beside that:
    they take turns."""
    part = host.parts[role]
    turns = CUDA_CAPTURE_LOCK if role == "learner" and getattr(part, "compiled", False) else contextlib.nullcontext()
    with turns:
        return _on_stream(host.streams.get(role), getattr(part, name), *args, **kwargs)


def _forwarder(role: str, name: str):
    # Ray pickles the class's methods by value: they refer to this module's functions (pickled by name), never to
    # its lock (a lock does not pickle).
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return _run_role(self, role, name, *args, **kwargs)

    method.__name__ = method.__qualname__ = f"{role}__{name}"
    return method
