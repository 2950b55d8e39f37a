"""Starting the run's Ray cluster (cluster/launch.py)."""

from __future__ import annotations

import os

import pytest

from miniverl.process import ProcessSettings
from tests.test_config import load


def actor_niceness(ray) -> int:
    """The niceness a Ray actor of the running cluster sees."""

    @ray.remote(num_cpus=0)
    class Probe:
        def niceness(self) -> int:
            return os.nice(0)

    return ray.get(Probe.remote().niceness.remote())


@pytest.mark.slow
def test_the_actors_of_a_started_cluster_run_at_the_drivers_priority():
    """Ray starts workers at niceness 15: beside two busy processes on 2 cores, a run's actors got ~3% of a core
    each and the default run wrote no step in 7 minutes. start_ray starts them at the driver's niceness."""
    ray = pytest.importorskip("ray")
    from miniverl.cluster.launch import start_ray

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already running in this process: start_ray would join it")
    cfg = load("resources.dashboard=false")
    assert start_ray(cfg, log=lambda *_: None)
    try:
        assert actor_niceness(ray) == os.nice(0)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_the_tests_own_ray_clusters_run_their_workers_at_the_drivers_priority_too():
    """The fixtures that start Ray themselves (tests/ray_local.py) start it as start_ray does: at Ray's default
    niceness the README's test command beside two busy processes sat for minutes in one Ray test."""
    ray = pytest.importorskip("ray")
    from tests.ray_local import init_local_ray

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already running in this process")
    init_local_ray(num_cpus=1)
    try:
        assert actor_niceness(ray) == os.nice(0)
    finally:
        ray.shutdown()


def test_an_actor_on_a_gpu_takes_flash_attention_unless_cudnn_is_asked_for(monkeypatch):
    """ProcessSettings.cudnn_attention: off (the default, every run actor's), torch's
    SDPA may not pick cuDNN, whose per-shape plans cost peers run 9's learner and teacher seconds a step."""
    import torch

    from miniverl.process import setup_process

    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # setup_process's CUDA branch, without a GPU
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert setup_process(ProcessSettings("cuda", torch_threads=1)) == "cuda"
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        setup_process(ProcessSettings("cuda", torch_threads=1, cudnn_attention=True))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(True)
        setup_process(ProcessSettings("cpu", torch_threads=1))  # a CPU actor leaves torch's attention settings alone
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_change_of_attention_setting_traces_compiled_code_afresh():
    """torch picks SDPA's kernel when it traces, and compiled code is reused across learners of one process: peers run
    10's learner bench ran its cuDNN cells on the layers its flash cell had compiled. After set_attention_backends
    changes the setting, compiled code is traced again; setting it to what it is reuses what is compiled."""
    import torch

    from miniverl.process import set_attention_backends

    traces = []

    def counting_backend(graph, example_inputs):
        traces.append(len(traces))
        return graph.forward

    before = torch.backends.cuda.cudnn_sdp_enabled()
    layer = torch.compile(lambda x: torch.sin(x) * 2, backend=counting_backend)
    try:
        torch.backends.cuda.enable_cudnn_sdp(False)
        for cudnn in (False, False, True, True, False):
            set_attention_backends(cudnn)
            assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn
            layer(torch.ones(3))
        assert len(traces) == 3  # the first call, then once after each change of setting
    finally:
        torch._dynamo.reset()
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("colocate", [False, True])
def test_the_launcher_keeps_every_actor_process_on_flash_attention(student_dir, teacher_dir, monkeypatch, colocate):
    """Every actor process build_actors starts, separate and colocated, is told to keep SDPA off cuDNN
    (ProcessSettings.cudnn_attention=False; Ray's calls stubbed: what is checked is what the launcher passes)."""
    import ray

    from miniverl.cluster import launch
    from miniverl.objectives.gkd import GkdObjective
    from miniverl.setup.prepare import prepare
    from tests.test_config import with_models

    started: list[ProcessSettings] = []

    def remote_actor(cls, num_cpus, num_gpus, placement, *args, **kwargs):
        started.extend(a for a in args if isinstance(a, ProcessSettings))
        return object()

    monkeypatch.setattr(launch, "remote_actor", remote_actor)
    monkeypatch.setattr(launch, "_wait_ready", lambda name, group: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    cfg = with_models(student_dir, teacher_dir, f"resources.colocate={colocate}")
    launch.build_actors(cfg, prepare(cfg, log=lambda *_: None), GkdObjective(0.5, 1.0, 0))
    assert len(started) == (1 if colocate else 3) and not any(p.cudnn_attention for p in started)


def test_a_ray_node_that_times_out_starting_is_one_line_with_the_fix(monkeypatch):
    """Ray's bare Exception for a node that did not come up (two local clusters started at once on a loaded machine)
    becomes a ConfigError naming the cause and the fix; any other exception passes through as it is."""
    import ray

    from miniverl.cluster.launch import ray_start_error, start_ray
    from miniverl.errors import ConfigError
    from tests.test_config import load

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already running in this process: start_ray would join it")

    def timed_out(**_kwargs):
        raise Exception(
            "The current node timed out during startup. This could happen because some of the raylet failed"
        )

    monkeypatch.setattr(ray, "init", timed_out)
    with pytest.raises(ConfigError, match=r"a local Ray node did not start in time .* overloaded .* run again"):
        start_ray(load(), log=lambda *_: None)
    other = ValueError("another problem")
    assert ray_start_error(other, None) is other
