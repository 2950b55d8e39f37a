"""One training run: check everything that can be checked cheaply, start the actors, loop, summarize."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miniverl.actors import call, call_all, check_cluster_resources, gpu_placement_group, remote_actor
from miniverl.config import MiniVerlConfig, validate
from miniverl.conformance import conformance_gate
from miniverl.controller import StrictSyncController, rollout_metrics
from miniverl.data.prompts import PromptSource
from miniverl.models.builtin import BUILTIN_PREFIX, BUILTIN_ROLES, BuiltinRecipe, ensure_builtin_models
from miniverl.models.loading import check_model_path, check_same_vocabulary, load_tokenizer
from miniverl.models.lora import LoraSettings
from miniverl.objectives import build_objective
from miniverl.placement import plan_placement
from miniverl.protocol import ConfigError, PromptBatch
from miniverl.rewards import ExactMatchReward
from miniverl.rollout.sampling import SamplingParams
from miniverl.tracking import Tracker
from miniverl.workers import ProcessSettings
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("resources.device=cuda but this machine has no usable CUDA GPU; use resources.device=cpu")
    return requested


def resolve_model_paths(cfg: MiniVerlConfig, log=print) -> dict[str, str]:
    """Model directories or hub ids for student and teacher; built-in models are built on first use."""
    specs = {"student": cfg.model.student.path, "teacher": cfg.model.teacher.path}
    out = {}
    for role, path in specs.items():
        if path.startswith(BUILTIN_PREFIX):
            which = path[len(BUILTIN_PREFIX) :]
            if which not in BUILTIN_ROLES:
                raise ConfigError(
                    f"model.{role}.path={path!r}: built-in models are builtin:student and builtin:teacher"
                )
            continue
        check_model_path(path, f"model.{role}.path")
        out[role] = path
    if len(out) < len(specs):
        recipe = BuiltinRecipe(cfg.data.task, cfg.data.min_len, cfg.data.max_len)
        built = ensure_builtin_models(cfg.model.cache_dir, recipe, log)
        for role, path in specs.items():
            out.setdefault(role, str(built[path[len(BUILTIN_PREFIX) :]]))
    return out


@dataclass
class Setup:
    """Everything checked and loaded in the driver before any actor starts."""

    device: str
    paths: dict[str, str]
    tokenizer: Any
    prompts: PromptSource
    train_batches: list[PromptBatch]
    eval_batch: PromptBatch
    stop_token_ids: tuple[int, ...]


def prepare(cfg: MiniVerlConfig, log=print) -> Setup:
    """Validate the config, resolve models, check vocabularies and every prompt the run will use."""
    from transformers import AutoConfig

    validate(cfg)
    device = resolve_device(cfg.resources.device)
    paths = resolve_model_paths(cfg, log)
    student_tok = load_tokenizer(paths["student"], "model.student.path")
    teacher_tok = load_tokenizer(paths["teacher"], "model.teacher.path")
    check_same_vocabulary(student_tok, teacher_tok, paths["student"], paths["teacher"])
    v_student = AutoConfig.from_pretrained(paths["student"]).vocab_size
    v_teacher = AutoConfig.from_pretrained(paths["teacher"]).vocab_size
    if v_student != v_teacher:
        raise ConfigError(
            f"student and teacher output {v_student} and {v_teacher} logits; distillation needs one vocabulary size"
            " (pick a teacher of the student's model family)"
        )
    if student_tok.eos_token_id is None:
        raise ConfigError(f"the student tokenizer at {paths['student']!r} has no EOS token; responses could never stop")
    d = cfg.data
    source = PromptSource(d.task, d.min_len, d.max_len, student_tok, d.max_prompt_length, d.seed)
    # Every prompt of the run is drawn (and length-checked) now, so a bad one fails before training.
    train = [source.batch(step, d.prompts_per_step) for step in range(cfg.trainer.total_steps)]
    return Setup(
        device,
        paths,
        student_tok,
        source,
        train,
        source.eval_batch(d.eval_prompts),
        (student_tok.eos_token_id,),
    )


def start_ray(cfg: MiniVerlConfig, log=print) -> bool:
    """Connect to (or start) Ray; print the dashboard URL. Returns True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"address": cfg.resources.ray_address, "log_to_driver": True}
    if cfg.resources.ray_address is None:
        # None lets Ray start the dashboard only when its packages (ray[default]) are installed.
        kwargs["include_dashboard"] = None if cfg.resources.dashboard else False
    ctx = ray.init(**kwargs)
    url = getattr(ctx, "dashboard_url", None)
    log(f"[miniverl] Ray dashboard: http://{url}" if url else "[miniverl] Ray dashboard: not running")
    return True


def resolve_gpus(cfg: MiniVerlConfig, device: str) -> int:
    """GPUs to place actors on: resources.gpus, or 1 when the run computes on CUDA, else 0."""
    if cfg.resources.gpus is None:
        return 1 if device == "cuda" else 0
    return cfg.resources.gpus


def build_actors(cfg: MiniVerlConfig, setup: Setup, objective) -> tuple[dict[str, list[Any]], Any]:
    """One rollout replica and learner rank per GPU (one of each without GPUs), and a scorer replica
    on each of those GPUs or on each of resources.scorer_gpus dedicated GPUs.

    Rollout replicas start first (an engine such as vLLM claims its memory budget at start). With
    GPUs, every replica sits in its GPU's placement bundle and takes its fraction of that GPU.
    """
    import ray

    res = cfg.resources
    gpus = resolve_gpus(cfg, setup.device)
    plan = plan_placement(res, gpus)
    check_cluster_resources(plan.totals(), ray.cluster_resources())
    pg = gpu_placement_group(plan.bundle_cpus) if plan.bundle_cpus else None

    def start(cls, actor: str, i: int, *args, **kwargs):
        share = plan.num_gpus[actor]
        cap = res.emulate_gpu_gib * share if (setup.device == "cuda" and res.emulate_gpu_gib) else None
        process = ProcessSettings(setup.device, res.torch_threads, cap)
        place = (pg, plan.bundle[actor][i]) if pg else None
        return remote_actor(cls, plan.num_cpus[actor], share, place, *args, process, **kwargs)

    lora = LoraSettings.from_config(cfg.model.lora)
    t, m = cfg.trainer, cfg.model
    student, teacher = setup.paths["student"], setup.paths["teacher"]
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
    rollouts = [
        start(RolloutWorker, "rollout", i, cfg.rollout.backend, student, lora, m.student.dtype)
        for i in range(plan.count["rollout"])
    ]
    _wait_ready("rollout", rollouts)  # before the others claim memory
    actors = {
        "rollout": rollouts,
        "scorer": [
            start(ScorerWorker, "scorer", i, teacher, m.teacher.dtype, t.micro_batch_size)
            for i in range(plan.count["scorer"])
        ],
        "learner": [
            start(LearnerWorker, "learner", i, *learner_args, rank=i, world_size=plan.count["learner"])
            for i in range(plan.count["learner"])
        ],
    }
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
            ray.get(actor.__ray_ready__.remote())
        except Exception as e:
            raise RuntimeError(f"the {name} actor (replica {i}) failed to start: {e}") from e


def teardown(actors: dict[str, list[Any]], pg) -> None:
    """Stop the actors and free their placement group, so a later run in this Ray cluster can start."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for group in actors.values():
        for actor in group:
            ray.kill(actor)
    if pg is not None:
        remove_placement_group(pg)


def evaluate(
    controller: StrictSyncController, batch: PromptBatch, cfg: MiniVerlConfig, stop_ids, reward_fn
) -> dict[str, float]:
    """Greedy accuracy and the temperature-1 reverse-KL estimate on the fixed eval prompts."""
    identity = controller.refresh()
    max_new = cfg.rollout.max_new_tokens
    greedy = controller.sample(batch, SamplingParams(1, max_new, 0.0, stop_token_ids=stop_ids), identity)
    sampled = controller.sample(
        batch, SamplingParams(1, max_new, 1.0, stop_token_ids=stop_ids, seed=cfg.rollout.seed + 17), identity
    )
    scores = controller.score(sampled, None)
    m = rollout_metrics(sampled, scores, reward_fn(sampled))
    return {
        "eval/accuracy": float(reward_fn(greedy).mean()),
        "eval/sampled_accuracy": m["accuracy"],
        "eval/reverse_kl": m["reverse_kl"],
    }


def train(cfg: MiniVerlConfig, run_dir: Path, config_dict: dict[str, Any], log=print) -> dict[str, Any]:
    """The whole run; returns the summary (also written to run_dir/summary.json)."""
    import ray

    started = time.perf_counter()
    setup = prepare(cfg, log)
    objective = build_objective(cfg.objective)
    started_ray = start_ray(cfg, log)
    tracker, actors, pg = None, {}, None
    try:
        actors, pg = build_actors(cfg, setup, objective)
        log(f"[miniverl] actors ready on {setup.device} ({time.perf_counter() - started:.1f}s since start)")
        reward_fn = ExactMatchReward(setup.tokenizer)
        controller = StrictSyncController(
            actors["rollout"],
            actors["scorer"],
            actors["learner"],
            reward_fn,
            objective.teacher_support_k,
            objective.loss_temperature,
        )
        r = cfg.rollout
        params = SamplingParams(r.n, r.max_new_tokens, r.temperature, r.top_k, r.top_p, setup.stop_token_ids)
        gate = conformance_gate(controller, setup.eval_batch, params, objective, (cfg.objective.name, r.backend), log)
        tracker = Tracker(
            run_dir,
            config_dict,
            cfg.tracking.wandb_mode,
            cfg.tracking.project,
            cfg.tracking.run_name,
            cfg.trainer.total_steps,
            cfg.tracking.progress_bar,
        )
        t = cfg.trainer
        first = evaluate(controller, setup.eval_batch, cfg, setup.stop_token_ids, reward_fn)
        tracker.log(0, first, advance=False)
        tracker.write(_eval_line(0, first))
        last = first
        for step in range(t.total_steps):
            step_params = dataclasses.replace(params, seed=r.seed * 100_003 + step)
            metrics = controller.step(setup.train_batches[step], step_params)
            done = step + 1
            if done == t.total_steps or (t.eval_every and done % t.eval_every == 0):
                last = evaluate(controller, setup.eval_batch, cfg, setup.stop_token_ids, reward_fn)
                metrics.update(last)
                tracker.write(_eval_line(done, last))
            tracker.log(done, metrics)
        checkpoint = None
        if t.save_checkpoint:
            checkpoint = call(actors["learner"][0], "save_checkpoint", str(run_dir / "checkpoint"))
        memory = {
            name if len(group) == 1 else f"{name}{i}": call(a, "memory")
            for name, group in actors.items()
            for i, a in enumerate(group)
        }
        summary = {
            "steps": t.total_steps,
            "objective": cfg.objective.name,
            "rollout_backend": r.backend,
            "device": setup.device,
            "start_reverse_kl": first["eval/reverse_kl"],
            "end_reverse_kl": last["eval/reverse_kl"],
            "start_accuracy": first["eval/accuracy"],
            "end_accuracy": last["eval/accuracy"],
            "wall_seconds": time.perf_counter() - started,
            "checkpoint": checkpoint,
            "metrics_file": str(tracker.metrics_path),
            "memory": memory,
            "conformance": gate,
        }
        tracker.finish(summary)
        tracker = None
        return summary
    finally:
        if tracker is not None:
            tracker.finish({"status": "failed"})
        if started_ray:
            ray.shutdown()
        else:
            teardown(actors, pg)


def _eval_line(step: int, m: dict[str, float]) -> str:
    return (
        f"[miniverl] eval @ step {step}: greedy accuracy {m['eval/accuracy']:.3f},"
        f" reverse KL {m['eval/reverse_kl']:.4f} nats/token"
    )
