"""resources.colocate (cluster/colocate.py): three roles in one actor, each called through its own handle, the roles'
calls at once and one role's calls in order."""

from __future__ import annotations

import threading
import time

import pytest

from miniverl.cluster.colocate import RoleHandle, actor_handle, colocated_class, processes
from miniverl.process import CUDA_CAPTURE_LOCK, ProcessSettings
from tests.ray_local import init_local_ray

CPU = ProcessSettings("cpu", torch_threads=1)


class Rollout:
    def __init__(self, name: str, process: ProcessSettings) -> None:
        self.name, self.loads = name, []

    def load(self, version: int) -> str:
        self.loads.append(version)
        return f"{self.name} serves v{version}"

    def _private(self) -> None:
        raise AssertionError("not exposed")


class Learner:
    def __init__(self, process: ProcessSettings, lr: float = 0.0) -> None:
        self.lr = lr

    def load(self, path: str) -> str:  # the same name as a rollout method: each role keeps its own
        return f"learner loaded {path} at lr {self.lr}"


def test_each_role_keeps_its_own_methods_and_its_handle_names_them():
    cls = colocated_class({"rollout": Rollout, "learner": Learner})
    assert {"rollout__load", "learner__load"} <= set(vars(cls)) and "rollout___private" not in vars(cls)
    host = cls({"rollout": (Rollout, ("r0", CPU), {}), "learner": (Learner, (CPU,), {"lr": 0.5})}, CPU)
    rollout, learner = RoleHandle(host, "rollout"), RoleHandle(host, "learner")
    assert rollout.load(3) == "r0 serves v3" and host.parts["rollout"].loads == [3]
    assert learner.load("ckpt") == "learner loaded ckpt at lr 0.5"
    assert actor_handle(learner) is host and actor_handle(host) is host
    with pytest.raises(AttributeError):
        rollout.__ray_ready__  # noqa: B018  Ray's members belong to the whole actor, reached through actor_handle
    with pytest.raises(ValueError, match="unknown roles \\['critic'\\]"):
        colocated_class({"critic": Learner})
    # one memory report per process: the colocated one once, separate actors by role (and replica)
    assert processes({"rollout": [rollout], "learner": [learner]}) == {"colocated": rollout}
    assert processes({"rollout": ["r"], "learner": ["l0", "l1"]}) == {
        "rollout": "r",
        "learner0": "l0",
        "learner1": "l1",
    }


class CompiledLearner:
    """A learner whose calls report whether another thread could take the capture lock while they ran."""

    def __init__(self, process: ProcessSettings, compiled: bool) -> None:
        self.compiled = compiled

    def update(self) -> bool:
        free = []
        probe = threading.Thread(target=lambda: free.append(_take_at_once(CUDA_CAPTURE_LOCK)))
        probe.start()
        probe.join()
        with CUDA_CAPTURE_LOCK:  # the learner's own cache release after an OOM takes it again (shrink_after_oom)
            pass
        return free[0]


def _take_at_once(lock) -> bool:
    if not lock.acquire(blocking=False):
        return False
    lock.release()
    return True


@pytest.mark.parametrize("compiled", [True, False])
def test_a_compiled_learner_and_the_rollouts_graph_captures_take_turns(compiled):
    # Inductor may compile, and synchronize the device, in whichever learner call meets a new shape; a colocated
    # rollout capturing a decode graph (under CUDA_CAPTURE_LOCK, rollout/hf_cached.py) must not run beside it.
    cls = colocated_class({"rollout": Rollout, "learner": CompiledLearner})
    host = cls({"rollout": (Rollout, ("r0", CPU), {}), "learner": (CompiledLearner, (CPU, compiled), {})}, CPU)
    learner = RoleHandle(host, "learner")
    assert learner.update() is (not compiled)  # a capture waits for a compiled learner's call, not an eager one's
    assert _take_at_once(CUDA_CAPTURE_LOCK)  # released after the call


@pytest.mark.slow
def test_two_roles_run_at_once_and_one_roles_calls_in_order():
    ray = pytest.importorskip("ray")
    from miniverl.cluster.actors import fetch, remote_actor, submit

    class Sleeper:  # defined here so Ray ships it by value (the test module is not importable in its workers)
        def __init__(self, process: ProcessSettings) -> None:
            pass

        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return time.monotonic()

    started_here = not ray.is_initialized()
    if started_here:
        init_local_ray(num_cpus=2)
    try:
        cls = colocated_class({"rollout": Sleeper, "learner": Sleeper})
        specs = {role: (Sleeper, (CPU,), {}) for role in ("rollout", "learner")}
        handle = remote_actor(cls, 1, 0, None, specs, CPU, concurrency_groups=("rollout", "scorer", "learner"))
        rollout, learner = RoleHandle(handle, "rollout"), RoleHandle(handle, "learner")
        fetch([submit(rollout, "nap", 0.0)])  # constructed
        t0 = time.monotonic()
        fetch([submit(rollout, "nap", 2.0), submit(learner, "nap", 2.0)])
        assert time.monotonic() - t0 < 3.6  # the two roles slept at once (one after the other: 4 s)
        t0 = time.monotonic()
        first, second = fetch([submit(learner, "nap", 1.0), submit(learner, "nap", 1.0)])
        assert time.monotonic() - t0 >= 2.0 and second - first >= 0.99  # one role's calls one after the other
        ray.kill(handle)
    finally:
        if started_here:
            ray.shutdown()


def test_a_process_takes_the_switch_interval_it_is_given_and_keeps_pythons_otherwise():
    """resources.switch_interval_ms reaches the colocated process as ProcessSettings.switch_interval_s."""
    import sys

    from miniverl.process import setup_process

    before = sys.getswitchinterval()
    try:
        setup_process(ProcessSettings("cpu", torch_threads=1, switch_interval_s=0.0005))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        sys.setswitchinterval(before)
        setup_process(CPU)
        assert sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)
