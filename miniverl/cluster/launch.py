"""Starting a run's cluster: Ray, then the actors on their GPUs (rollout replicas first), and tearing it down."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from miniverl.cluster.actors import call, call_all, check_cluster_resources, gpu_placement_group, remote_actor
from miniverl.cluster.colocate import ROLES, RoleHandle, actor_handle, colocated_class, processes
from miniverl.cluster.faults import shielded_children
from miniverl.config import MiniVerlConfig
from miniverl.process import COLOCATED_CONTEXT_GIB, ProcessSettings, emulated_cap_gib, emulated_card_gib
from miniverl.routing import teacher_name
from miniverl.setup.records import Setup
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from miniverl.workers.teachers import TeacherLoad, TeachersScorerWorker

if TYPE_CHECKING:
    from miniverl.objectives.interface import Objective

# Ray starts its workers at niceness 15, so every actor of a run yields the cores to any ordinary process: beside two
# busy processes on 2 cores the default run had written no step after 7 minutes (lab/results/default-run-cpu.md).
# The actors are the run's work, not background chores: they start at the driver's priority. (A cluster this run
# joins, resources.ray_address, keeps its own setting.)
WORKER_NICENESS = 0


def start_ray(cfg: MiniVerlConfig, log=print) -> bool:
    """Connect to (or start) Ray; print the dashboard URL. Returns True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"address": cfg.resources.ray_address, "log_to_driver": True}
    if cfg.resources.ray_address is None:
        # None lets Ray start the dashboard only when its packages (ray[default]) are installed.
        kwargs["include_dashboard"] = None if cfg.resources.dashboard else False
        kwargs["_system_config"] = {"worker_niceness": WORKER_NICENESS}
    with shielded_children(), kept_signal_handlers():  # a group signal must not kill Ray under the driver
        try:
            ctx = ray.init(**kwargs)
        except Exception as e:  # Ray raises a bare Exception for a node that did not come up
            raise ray_start_error(e, cfg.resources.ray_address) from e
    url = getattr(ctx, "dashboard_url", None)
    log(f"[miniverl] Ray dashboard: http://{url}" if url else "[miniverl] Ray dashboard: not running")
    return True


@contextlib.contextmanager
def kept_signal_handlers():
    """The driver's SIGINT and SIGTERM handlers as they were before the block, put back after it. ray.init installs
    handlers of its own (its core worker's C++ failure handler dumps a stack for SIGTERM), which replaced the run's
    StartupSignals: `timeout` during actor start-up printed Ray's dump instead of one line and wrote no summary.json.
    Main thread only (elsewhere signals cannot be set)."""
    main_thread = threading.current_thread() is threading.main_thread()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not None:  # None: set outside Python, nothing to put back
                signal.signal(s, handler)  # re-set even when Python sees it unchanged: C code may have replaced it


def ray_start_error(e: Exception, address: str | None) -> Exception:
    """Ray's start-up failure as one line with the fix, or `e` itself when it is not one Ray names. Two local clusters
    started at the same instant on a loaded 2-core machine both timed out ("The current node timed out during
    startup", 2026-12-07), and Ray's message reaches the user through Hydra's traceback with no hint."""
    from miniverl.errors import ConfigError

    text = str(e)
    if "timed out during startup" in text or "Deadline Exceeded" in text:
        where = f"the Ray cluster at resources.ray_address={address}" if address else "a local Ray node"
        return ConfigError(
            f"{where} did not start in time ({text.splitlines()[0][:160]}); the machine is likely overloaded or"
            " another Ray is starting beside it: wait for the other processes (or `ray stop`), then run again"
        )
    return e


def actor_threads(torch_threads: int, cores: int) -> int:
    """Torch threads per actor: an explicit resources.torch_threads, else (0, the default) half the cores, at least
    one. All-core pools fight whatever else computes: with trainer.staleness=1 two all-core pools on 2 CPU cores made
    a stale step 4.5x slower than strict sync, one thread each 1.39x faster (lab/results/staleness-cpu.md); in
    strict sync beside two busy processes on 2 cores the default run took 1.84 s a step with two threads per actor
    and 0.82 s with one, at 8% of cost on idle cores (lab/results/default-run-cpu.md)."""
    return torch_threads or max(1, cores // 2)


def build_actors(cfg: MiniVerlConfig, setup: Setup, objective: Objective) -> tuple[dict[str, list[Any]], Any]:
    """One rollout replica and learner rank per GPU (one of each without GPUs), and a scorer replica
    on each of those GPUs or on each of resources.scorer_gpus dedicated GPUs; with model.teacher.path=self no scorer,
    and the learners stand in for it (actors["scorer"] is actors["learner"]).

    Rollout replicas start first (an engine such as vLLM claims its memory budget at start). With
    GPUs, every replica sits in its GPU's placement bundle and takes its fraction of that GPU.
    """
    import ray

    res = cfg.resources
    plan = setup.placement  # resolved before Ray (setup/prepare.py), as are the LoRA and engine settings
    if plan is None or setup.lora is None:
        raise ValueError(
            "build_actors needs a Setup from setup.prepare.load_setup (or prepare): this one has no placement"
        )
    check_cluster_resources(plan.totals(), ray.cluster_resources())
    pg = gpu_placement_group(plan.bundle_cpus) if plan.bundle_cpus else None

    card = emulated_card_gib(res.emulate_gpu_gib, setup.device)

    def gpu_cap_gib(actor: str) -> float | None:
        """The actor's torch cap on the emulated card, or None without emulation (setup/prepare.py sized the rollout
        engine by the same rule)."""
        return None if card is None else emulated_cap_gib(card, plan.num_gpus[actor], f"{actor} share")

    threads = actor_threads(res.torch_threads, os.cpu_count() or 1)
    colocated: dict[str, tuple[type, tuple, dict]] = {}  # resources.colocate: each role's constructor, built below

    def start(cls, actor: str, i: int, *args, **kwargs):
        share = plan.num_gpus[actor]
        process = ProcessSettings(setup.device, threads, gpu_cap_gib(actor), share, actor=True)
        if res.colocate:  # the role's share sizes its work; the colocated process's cap is their sum
            colocated[actor] = (cls, (*args, dataclasses.replace(process, process_cap=False)), kwargs)
            return actor  # a placeholder until the one actor exists
        place = (pg, plan.bundle[actor][i]) if pg else None
        return remote_actor(cls, plan.num_cpus[actor], share, place, *args, process, **kwargs)

    lora = setup.lora
    t, m = cfg.trainer, cfg.model
    student, teacher = setup.paths["student"], setup.paths.get("teacher")
    learner_args = (
        student,
        lora,
        m.student.dtype,
        objective,
        t.lr,
        t.weight_decay,
        t.max_grad_norm,
        t.micro_batch_size,
    )
    options = {}
    if setup.engine is not None:  # vLLM's or SGLang's settings for its share
        options = {"settings": setup.engine}
    elif m.student.quantization != "none":  # hf_reference serves the 4-bit base as the learner loads it
        options = {"quantization": m.student.quantization}
    rollouts = [
        start(RolloutWorker, "rollout", i, cfg.rollout.backend, student, lora, m.student.dtype, backend_options=options)
        for i in range(plan.count["rollout"])
    ]
    if not res.colocate:
        _wait_ready("rollout", rollouts)  # before the others claim memory
    # what the scorer's forwards are sized for: the objective's support, and rows as long as a rollout's
    scoring = {
        "support_k": objective.teacher_support_k,
        "loss_temperature": objective.loss_temperature,
        "max_row_tokens": cfg.longest_row,
    }
    if setup.routing is not None:  # several teachers: one scorer actor holds them all (workers/teachers.py)
        loads = {
            teacher_name(role): TeacherLoad(setup.paths[role], dtype, quantization)
            for role, (dtype, quantization) in setup.teacher_precisions.items()
        }
        scorers = [
            start(
                TeachersScorerWorker,
                "scorer",
                i,
                loads,
                setup.routing,
                t.micro_batch_size,
                vocab_size=setup.vocab_size,
                chunk_tokens=t.logprob_chunk_tokens,
                max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
                **scoring,
            )
            for i in range(plan.count["scorer"])
        ]
    actors = {
        "rollout": rollouts,
        "scorer": scorers
        if setup.routing is not None
        else []
        if m.teacher_is_self  # the learners score (LearnerWorker.score): handed over as the scorers below
        else [
            start(
                ScorerWorker,
                "scorer",
                i,
                teacher,
                m.teacher.dtype,
                t.micro_batch_size,
                vocab_size=setup.vocab_size,
                quantization=m.teacher.quantization,
                chunk_tokens=t.logprob_chunk_tokens,
                max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
                **scoring,
            )
            for i in range(plan.count["scorer"])
        ],
        "learner": [
            start(
                LearnerWorker,
                "learner",
                i,
                *learner_args,
                rank=i,
                world_size=plan.count["learner"],
                on_nonfinite=t.on_nonfinite,
                quantization=m.student.quantization,
                logprob_chunk_tokens=t.logprob_chunk_tokens,
                gradient_checkpointing=t.gradient_checkpointing,
                max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
                max_row_tokens=cfg.longest_row,
                staleness=t.staleness,
                loss_weight_by_source=dict(t.loss_weight_by_source),
                compile_layers=t.compile_layers,
            )
            for i in range(plan.count["learner"])
        ],
    }
    if res.colocate:
        share = sum(plan.num_gpus[role] for role in ROLES)
        # one CUDA context for the three roles: the process may use the sum of their shares less that context
        cap = None
        if card is not None:
            cap = emulated_cap_gib(card, share, "the colocated shares", COLOCATED_CONTEXT_GIB)
        switch = None if res.switch_interval_ms is None else res.switch_interval_ms / 1e3
        process = ProcessSettings(setup.device, threads, cap, share, actor=True, switch_interval_s=switch)
        cpus = sum(plan.num_cpus[role] for role in ROLES)
        cls = colocated_class({role: spec[0] for role, spec in colocated.items()})
        handle = remote_actor(cls, cpus, share, (pg, 0) if pg else None, colocated, process, concurrency_groups=ROLES)
        _wait_ready("colocated", [handle])
        actors = {role: [RoleHandle(handle, role)] for role in ROLES if role in colocated}
    if m.teacher_is_self:
        actors["scorer"] = actors["learner"]  # the same handles: one process, its adapter off while it scores
    _wait_ready("scorer", actors["scorer"])
    _wait_ready("learner", actors["learner"])
    if plan.count["learner"] > 1:
        host, port = call(actors["learner"][0], "distributed_address")
        call_all(actors["learner"], "init_distributed", [(host, port)] * plan.count["learner"])
    return actors, pg


def _wait_ready(name: str, group: list[Any]) -> None:
    """Surface a constructor failure here, naming the actor."""
    import ray

    for i, actor in enumerate(group):
        try:
            ray.get(actor_handle(actor).__ray_ready__.remote())
        except Exception as e:
            raise RuntimeError(f"the {name} actor (replica {i}) failed to start: {e}") from e


def teardown(actors: dict[str, list[Any]], pg) -> None:
    """Stop the actors and free their placement group, so a later run in this Ray cluster can start."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in processes(actors).values():  # a colocated actor is killed once, not once per role
        ray.kill(actor_handle(actor))
    if pg is not None:
        remove_placement_group(pg)
