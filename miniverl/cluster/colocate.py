"""resources.colocate: the rollout replica, the scorer and the learner of one GPU in ONE actor process.

Separate actor processes share a GPU by time-slicing: their kernels never run at once, so overlapping the next
rollout with the update (trainer.staleness=1) bought 0.97x on an H200 (docs/benchmarks/staleness-gpu.md). In one
process each role computes on its own CUDA stream and Ray runs each role's calls on its own thread (one
concurrency group per role), so a rollout's decode kernels can run beside the learner's update; and the process
pays one CUDA context instead of three.

The controller is unchanged: each role is handed a RoleHandle, which turns `handle.method` into the colocated
actor's `role__method`, so submit/call/fetch (cluster/actors.py) work as with three actors.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from miniverl.workers import ProcessSettings, setup_process

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


def colocated_class(parts: dict[str, type], concurrency_groups: bool = True) -> type:
    """A class whose instance holds one object of each `parts[role]` and exposes each public method `name` of that
    role's class as `role__name`, run on the role's CUDA stream; with `concurrency_groups` (the Ray actor) each such
    method is in the role's concurrency group, so different roles' calls can run at once."""
    unknown = set(parts) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}; colocated roles are {ROLES}")
    members: dict[str, Any] = {"__init__": _init, "__module__": __name__, "__qualname__": "Colocated"}
    for role, cls in parts.items():
        for name, _ in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_"):
                members[f"{role}__{name}"] = _forwarder(role, name, concurrency_groups)
    return type("Colocated", (), members)


def _init(self, specs: dict[str, tuple[type, tuple, dict]], process: ProcessSettings) -> None:
    """`specs[role]` = (class, args, kwargs) as each role's own actor would be built; `process`: this process's
    settings, its memory cap the sum of the roles' (their own settings carry their shares for sizing only)."""
    self.device = setup_process(process)
    self.parts = {}
    for role in ROLES:
        if role in specs:
            cls, args, kwargs = specs[role]
            self.parts[role] = cls(*args, **kwargs)
    self.streams = {}
    if self.device == "cuda":
        self.streams = {role: torch.cuda.Stream() for role in self.parts}
        torch.cuda.synchronize()  # what the constructors queued on the default stream is done before any role's stream


def _forwarder(role: str, name: str, concurrency_group: bool):
    def method(self, *args: Any, **kwargs: Any) -> Any:
        target = getattr(self.parts[role], name)
        stream = self.streams.get(role)
        if stream is None:
            return target(*args, **kwargs)
        with torch.cuda.stream(stream):
            out = target(*args, **kwargs)
        stream.synchronize()  # the call's GPU work is done when its result is (as across processes); others run on
        return out

    method.__name__ = method.__qualname__ = f"{role}__{name}"
    if concurrency_group:
        import ray

        method = ray.method(concurrency_group=role)(method)
    return method
