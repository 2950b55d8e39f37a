"""The one place that turns worker classes into Ray actors, and calls them the same way in-process."""

from __future__ import annotations

from typing import Any

from miniverl.protocol import ConfigError


def remote_actor(cls: type, name: str, num_cpus: float, num_gpus: float, *args: Any, **kwargs: Any):
    """Start `cls(*args, **kwargs)` as a Ray actor holding the given resources."""
    import ray

    actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(cls)
    return actor_cls.options(name=None, max_concurrency=1).remote(*args, **kwargs)


def call(actor: Any, method: str, *args: Any) -> Any:
    """Call `method` on a Ray actor handle (and wait) or on a plain in-process object."""
    fn = getattr(actor, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args))
    return fn(*args)


def check_cluster_resources(requested: dict[str, dict[str, float]], available: dict[str, float]) -> None:
    """Fail with the shortfall per resource when the actors ask for more than the Ray cluster has.

    requested: {actor name: {"CPU": x, "GPU": y}}; available: ray.cluster_resources().
    """
    problems = []
    for res in ("CPU", "GPU"):
        want = sum(r.get(res, 0.0) for r in requested.values())
        have = available.get(res, 0.0)
        if want > have + 1e-9:
            parts = " + ".join(f"{a} {r.get(res, 0.0):g}" for a, r in requested.items())
            problems.append(f"{want:g} {res} ({parts}) but the Ray cluster has {have:g}")
    if problems:
        raise ConfigError(
            "the actors ask for " + "; ".join(problems) + ". Lower resources.<actor>.num_gpus / num_cpus,"
            " or set resources.device=cpu to run without a GPU"
        )
