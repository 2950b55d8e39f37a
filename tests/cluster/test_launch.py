"""Starting the run's Ray cluster (cluster/launch.py)."""

from __future__ import annotations

import os

import pytest

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
