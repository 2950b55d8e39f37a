"""A local Ray cluster for the tests that start their own, started as the product starts one
(cluster/launch.py start_ray): its workers at the driver's priority, not Ray's default niceness 15, under which
the tests' actors starve beside other work on the machine (issue 38: the README's test command beside two busy
processes sat in one Ray test for minutes)."""

from __future__ import annotations


def init_local_ray(**kwargs):
    import ray

    from miniverl.cluster.launch import WORKER_NICENESS

    return ray.init(
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"worker_niceness": WORKER_NICENESS},
        **kwargs,
    )
