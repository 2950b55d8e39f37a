"""Where each actor replica goes: a pure plan from the resources config, tested without Ray.

The one-GPU layout (a rollout replica, a scorer replica and a learner rank sharing the GPU by their
`num_gpus` fractions) repeats on each of `gpus` GPUs. With `scorer_gpus = M > 0` the scorer replicas
move to M more GPUs, one each and whole, and the shared GPUs hold only rollout and learner. A run whose teacher is
the student's own base (model.teacher.path=self) has no scorer replica: the learners score.
Without GPUs there is one replica of each and no placement group.
"""

from __future__ import annotations

from dataclasses import dataclass

from miniverl.errors import ConfigError

ACTORS = ("rollout", "scorer", "learner")


@dataclass(frozen=True)
class Placement:
    count: dict[str, int]  # replicas per actor
    num_gpus: dict[str, float]  # GPU fraction each replica asks for
    num_cpus: dict[str, float]  # CPUs each replica asks for
    bundle_cpus: list[float]  # one placement bundle {GPU: 1, CPU: c} per GPU; empty without GPUs
    bundle: dict[str, list[int]]  # the bundle index of each replica

    def totals(self) -> dict[str, dict[str, float]]:
        """{actor: {"CPU": x, "GPU": y}} over all replicas, for the cluster check."""
        return {a: {"CPU": self.num_cpus[a] * self.count[a], "GPU": self.num_gpus[a] * self.count[a]} for a in ACTORS}


def placement_gpus(requested: int | None, device: str) -> int:
    """GPUs to place actors on: resources.gpus (`requested`), or 1 when the run computes on CUDA, else 0."""
    if requested is None:
        return 1 if device == "cuda" else 0
    return requested


def replica_share(num_gpus: float | None, actor: str, gpus: int) -> float:
    """The GPU fraction one replica of `actor` asks for: none without GPUs (`gpus` 0), else its
    resources.<actor>.num_gpus (`num_gpus`), or config.UNPLANNED_SHARES' where no plan chose a null one."""
    from miniverl.config import UNPLANNED_SHARES

    if not gpus:
        return 0.0
    return UNPLANNED_SHARES[actor] if num_gpus is None else num_gpus


def plan_placement(resources, gpus: int, scorer: bool = True) -> Placement:
    """The placement for `gpus` shared GPUs (0 = CPU only) and resources.scorer_gpus dedicated ones; `scorer` False:
    no scorer replica (model.teacher.path=self), so it asks for no GPU or CPU."""
    dedicated = resources.scorer_gpus if gpus else 0
    share = {a: replica_share(getattr(resources, a).num_gpus, a, gpus) for a in ACTORS}
    if dedicated:
        share["scorer"] = 1.0
    cpus = {a: getattr(resources, a).num_cpus for a in ACTORS}
    if not scorer:
        share["scorer"], cpus["scorer"] = 0.0, 0.0
    shared = [a for a in ACTORS if not (dedicated and a == "scorer")]
    on_one_gpu = {a: share[a] for a in shared}
    if gpus and sum(on_one_gpu.values()) > 1 + 1e-9:
        raise ConfigError(
            f"the actors on one GPU ask for {sum(on_one_gpu.values()):g} of it ({on_one_gpu});"
            " the fractions resources.<actor>.num_gpus must sum to at most 1"
        )
    replicas = max(1, gpus)
    count = {"rollout": replicas, "learner": replicas, "scorer": (dedicated or replicas) if scorer else 0}
    bundle = {"rollout": list(range(gpus)), "learner": list(range(gpus))}
    bundle["scorer"] = list(range(gpus, gpus + dedicated)) if dedicated else list(range(gpus))
    bundle_cpus = [sum(cpus[a] for a in shared)] * gpus + [cpus["scorer"]] * dedicated
    return Placement(count, share, cpus, bundle_cpus, bundle)
