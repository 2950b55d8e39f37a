"""The one place that turns worker classes into Ray actors, and calls them the same way in-process."""

from __future__ import annotations

from typing import Any

from miniverl.errors import ConfigError


def remote_actor(
    cls: type,
    num_cpus: float,
    num_gpus: float,
    placement: tuple[Any, int] | None,
    *args: Any,
    concurrency_groups: tuple[str, ...] = (),
    **kwargs: Any,
):
    """Start `cls(*args, **kwargs)` as a Ray actor holding the given resources, in bundle
    `placement = (placement_group, bundle_index)` when given. Its calls run one at a time; with
    `concurrency_groups`, a method named `<group>__<name>` runs in that group, one call at a time per group
    (a colocated actor's roles, cluster/colocate.py)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": 1}

    if placement is not None:
        pg, index = placement
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        )
    groups = {group: 1 for group in concurrency_groups}  # Ray takes them with the class, not in .options()
    for name, fn in list(vars(cls).items()):
        group = name.split("__", 1)[0]
        if callable(fn) and group in groups:
            setattr(cls, name, ray.method(concurrency_group=group)(fn))
    remote_cls = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
    return remote_cls.options(**options).remote(*args, **kwargs)


def gpu_placement_group(cpus_per_bundle: list[float], timeout_s: float = 120.0):
    """One bundle {GPU: 1, CPU: c} per entry, all on one host (STRICT_PACK), ready or an error."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = [{"GPU": 1, "CPU": c} for c in cpus_per_bundle]
    pg = placement_group(bundles, strategy="STRICT_PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise ConfigError(
            f"Ray could not place {len(bundles)} bundles {bundles} on one host within {timeout_s:g}s"
            f" (cluster: {ray.cluster_resources()}); lower resources.gpus / scorer_gpus or the actors' num_cpus"
        )
    return pg


def call(actor: Any, method: str, *args: Any) -> Any:
    """Call `method` on a Ray actor handle (and wait) or on a plain in-process object."""
    return fetch([submit(actor, method, *args)])[0]


def submit(actor: Any, method: str, *args: Any) -> Any:
    """Start `method` without waiting: its ObjectRef on a Ray actor, its value on a plain in-process object.

    Passing the ref on as an argument of another actor call hands the value from producer to consumer
    through Ray's object store, never through the driver (the adapter: learner -> rollout replicas).
    Calls submitted from one driver to one actor run in submission order.
    """
    fn = getattr(actor, method)
    return fn.remote(*args) if hasattr(fn, "remote") else fn(*args)


def fetch(handles: list[Any]) -> list[Any]:
    """Wait for handles from `submit`: Ray refs become their values (fetched together), values pass through."""
    import sys

    if "ray" not in sys.modules:  # no Ray imported, so no refs: everything ran in-process
        return list(handles)
    import ray

    refs = [i for i, h in enumerate(handles) if isinstance(h, ray.ObjectRef)]
    if not refs:  # ray.get would start a Ray session just to return nothing (Ray's auto-init)
        return list(handles)
    out = list(handles)
    for i, value in zip(refs, ray.get([handles[i] for i in refs])):
        out[i] = value
    return out


def settle(handles: list[Any]) -> None:
    """Wait until every Ray ref among `handles` is computed, without fetching its value to the driver (values
    from in-process objects are already there). Lets the driver time a stage whose result goes elsewhere."""
    import sys

    if "ray" not in sys.modules:
        return
    import ray

    refs = [h for h in handles if isinstance(h, ray.ObjectRef)]
    if refs:
        ray.wait(refs, num_returns=len(refs), fetch_local=False)


def call_all(actors: list[Any], method: str, args: list[tuple]) -> list[Any]:
    """Call `method` on every actor with its own arguments, concurrently for Ray actors, and wait."""
    if len(actors) != len(args):
        raise ValueError(f"{len(actors)} actors but {len(args)} argument tuples")
    return fetch([submit(actor, method, *a) for actor, a in zip(actors, args)])


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
