"""Setting up one training run: check everything that can be checked cheaply, resolve resume, start Ray and
the actors, hand over to the loop (loop.py), summarize."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miniverl.actors import call, call_all, check_cluster_resources, gpu_placement_group, remote_actor
from miniverl.checkpoints.compat import identity_hash
from miniverl.config import MiniVerlConfig, validate
from miniverl.conformance import conformance_gate
from miniverl.controller import StrictSyncController
from miniverl.dashboard import RunGauges
from miniverl.data.build import PromptStream, build_prompt_source
from miniverl.evaluation import summary_by_source
from miniverl.faults import RunInterrupted, StopRequests, shielded_children
from miniverl.loop import TrainingLoop
from miniverl.models.builtin import (
    BuiltinRecipe,
    built_accuracy,
    ensure_builtin_models,
    parse_builtin_ref,
    require_competent_teacher,
)
from miniverl.models.hub import check_model_dir, resolve_model_ref
from miniverl.models.loading import (
    check_same_vocabulary,
    load_model_config,
    load_tokenizer,
    require_quantization,
    shared_vocab_size,
)
from miniverl.models.logprobs import check_plain_logits
from miniverl.models.lora import LoraSettings
from miniverl.models.memory import check_vocab_memory
from miniverl.models.stops import resolve_stop_ids
from miniverl.objectives import build_objective
from miniverl.placement import plan_placement
from miniverl.plots import write_plots
from miniverl.preflight import (
    check_device_settings,
    check_gpu_request,
    check_lora_targets,
    check_tracking,
    resolve_resume,
)
from miniverl.protocol import ConfigError, MiniVerlError, PromptBatch
from miniverl.rewards import SourceReward, build_reward
from miniverl.rollout.sampling import SamplingParams
from miniverl.rollout.vllm_settings import require_vllm, settings_from_config
from miniverl.seeds import sampling_seed
from miniverl.teachers import TeacherRouting, check_sources_routed, routing_of, teacher_name, teacher_specs
from miniverl.tracking import Tracker, trim_metrics
from miniverl.workers import ProcessSettings, emulated_cap_gib
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from miniverl.workers.teachers import TeacherLoad, TeachersScorerWorker


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("resources.device=cuda but this machine has no usable CUDA GPU; use resources.device=cpu")
    return requested


USER_MODEL_FIX = "re-save the model (save_pretrained) or download it again"


def resolve_model_paths(cfg: MiniVerlConfig, log=print) -> dict[str, str]:
    """Model directories or hub ids for the student and every teacher; built-in models are built on first use.

    Keys: "student", and "teacher" (model.teacher) or "teachers.<name>" (model.teachers.<name>). Each role
    resolves on its own, so a local model for one role and a built-in one for another works; a built-in ref
    `builtin:teacher/<task>` names another task's teacher. A built-in teacher below
    model.builtin_min_teacher_accuracy stops the run.
    """
    specs = {"student": cfg.model.student.path, **{r: s.path for r, s in teacher_specs(cfg.model).items()}}
    out, builtin = {}, {}
    for role, path in specs.items():
        ref = parse_builtin_ref(path, cfg.data.task, f"model.{role}.path")
        if ref is not None:
            builtin[role] = ref
        else:
            out[role] = resolve_model_ref(path, f"model.{role}.path", USER_MODEL_FIX)
    for task in dict.fromkeys(task for _, task in builtin.values()):  # each recipe built once, in order
        recipe = BuiltinRecipe(task, cfg.data.min_len, cfg.data.max_len)
        roles = tuple(which for which, t in builtin.values() if t == task)
        built = ensure_builtin_models(cfg.model.cache_dir, recipe, log, roles)
        for role, (which, _) in ((r, ref) for r, ref in builtin.items() if ref[1] == task):
            fix = f"delete {built[which].parent} so the built-in models are rebuilt (scripts/build_models.py)"
            check_model_dir(built[which], f"model.{role}.path={specs[role]} (cached)", fix)
            out[role] = str(built[which])
        if "teacher" in roles:
            accuracy = built_accuracy(built["teacher"])
            log(f"[miniverl] built-in teacher for task {recipe.task!r}: greedy accuracy {accuracy:.3f}")
            require_competent_teacher(accuracy, cfg.model.builtin_min_teacher_accuracy, recipe, built["teacher"])
    return out


@dataclass
class Setup:
    """Everything checked and loaded in the driver before any actor starts."""

    device: str
    paths: dict[str, str]
    tokenizer: Any
    prompts: PromptStream  # prompts.batch(step, g): the step's prompts, a pure function of (seed, step)
    eval_batch: PromptBatch
    stop_token_ids: tuple[int, ...]
    vocab_size: int  # logits compared by distillation (the student's; the scorer drops a teacher's extra)
    reward_fn: SourceReward
    routing: TeacherRouting | None = None  # several teachers (model.teachers); None: model.teacher scores all


def prepare(cfg: MiniVerlConfig, log=print) -> Setup:
    """Validate the config, resolve models, check vocabularies, stop ids, prompts and their rewards."""
    validate(cfg)
    device = resolve_device(cfg.resources.device)
    if cfg.rollout.backend == "vllm":
        require_vllm(device)
    teachers = teacher_specs(cfg.model)
    for role, spec in (("student", cfg.model.student), *teachers.items()):
        require_quantization(spec.quantization, device, f"model.{role}.quantization")
    paths = resolve_model_paths(cfg, log)
    student_tok = load_tokenizer(paths["student"], "model.student.path", USER_MODEL_FIX)
    configs = {role: load_model_config(paths[role], f"model.{role}.path", USER_MODEL_FIX) for role in paths}
    for role, config in configs.items():
        check_plain_logits(config, f"model.{role}.path={paths[role]!r}")
    v_student = configs["student"].vocab_size
    for role in teachers:  # every teacher meets the vocabulary rules on its own
        teacher_tok = load_tokenizer(paths[role], f"model.{role}.path", USER_MODEL_FIX)
        check_same_vocabulary(student_tok, teacher_tok, paths["student"], paths[role])
        vocab_size = shared_vocab_size(v_student, configs[role].vocab_size, len(student_tok))
    t, r = cfg.trainer, cfg.rollout
    check_vocab_memory(
        cfg.data.prompts_per_step * r.n,
        r.max_new_tokens,
        vocab_size,
        build_objective(cfg.objective).teacher_support_k,
        t.micro_batch_size,
        t.logprob_chunk_tokens,
        t.vocab_memory_budget_gib,
        t.max_tokens_per_micro_batch,
    )
    stops = resolve_stop_ids(student_tok, paths["student"], cfg.rollout.stop_token_ids, v_student)
    d = cfg.data
    source = build_prompt_source(d, student_tok, cfg.trainer.total_steps, log)
    eval_batch = source.eval_batch(d.eval_prompts)
    reward_fn = build_reward(cfg.reward, student_tok)
    seen_sources = eval_batch.data_source + source.batch(0, d.prompts_per_step).data_source
    reward_fn.check_sources(seen_sources)
    routing = routing_of(cfg.model)
    check_sources_routed(routing, seen_sources)
    return Setup(device, paths, student_tok, source, eval_batch, stops, vocab_size, reward_fn, routing)


def start_ray(cfg: MiniVerlConfig, log=print) -> bool:
    """Connect to (or start) Ray; print the dashboard URL. Returns True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"address": cfg.resources.ray_address, "log_to_driver": True}
    if cfg.resources.ray_address is None:
        # None lets Ray start the dashboard only when its packages (ray[default]) are installed.
        kwargs["include_dashboard"] = None if cfg.resources.dashboard else False
    with shielded_children():  # a signal to the whole process group must not kill Ray under the driver
        ctx = ray.init(**kwargs)
    url = getattr(ctx, "dashboard_url", None)
    log(f"[miniverl] Ray dashboard: http://{url}" if url else "[miniverl] Ray dashboard: not running")
    return True


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


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

    def gpu_cap_gib(actor: str) -> float | None:
        """The actor's torch cap on the emulated GPU (resources.emulate_gpu_gib), or None without emulation."""
        emulated = setup.device == "cuda" and res.emulate_gpu_gib
        return emulated_cap_gib(res.emulate_gpu_gib, plan.num_gpus[actor], f"{actor} share") if emulated else None

    def start(cls, actor: str, i: int, *args, **kwargs):
        share = plan.num_gpus[actor]
        process = ProcessSettings(setup.device, res.torch_threads, gpu_cap_gib(actor), share, actor=True)
        place = (pg, plan.bundle[actor][i]) if pg else None
        return remote_actor(cls, plan.num_cpus[actor], share, place, *args, process, **kwargs)

    lora = LoraSettings.from_config(cfg.model.lora)
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
    if cfg.rollout.backend == "vllm":
        options = {"settings": settings_from_config(cfg, plan.num_gpus["rollout"], gpu_cap_gib("rollout"))}
    elif m.student.quantization != "none":  # hf_reference serves the 4-bit base as the learner loads it
        options = {"quantization": m.student.quantization}
    rollouts = [
        start(RolloutWorker, "rollout", i, cfg.rollout.backend, student, lora, m.student.dtype, backend_options=options)
        for i in range(plan.count["rollout"])
    ]
    _wait_ready("rollout", rollouts)  # before the others claim memory
    if setup.routing is not None:  # several teachers: one scorer actor holds them all (workers/teachers.py)
        loads = {
            teacher_name(role): TeacherLoad(setup.paths[role], spec.dtype, spec.quantization)
            for role, spec in teacher_specs(m).items()
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
            )
            for i in range(plan.count["scorer"])
        ]
    actors = {
        "rollout": rollouts,
        "scorer": scorers
        if setup.routing is not None
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
                max_row_tokens=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                staleness=t.staleness,
            )
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


def train(
    cfg: MiniVerlConfig,
    run_dir: Path,
    config_dict: dict[str, Any],
    log=print,
    after_step: Callable[[int, dict[str, list[Any]]], None] | None = None,
    run_files: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The whole run; returns the summary (also written to run_dir/summary.json).

    Everything that can be checked is checked before Ray starts. `after_step(step, actors)` runs after
    each completed step (tests use it to inject faults). `run_files` (path in run_dir -> text: main's
    .hydra/*.yaml) are written once every check has passed, so a refused run touches nothing.
    """
    import ray

    started = time.perf_counter()
    validate(cfg)
    typed_config = dataclasses.asdict(cfg)
    resume = resolve_resume(cfg, run_dir, typed_config, log)  # first: a used run directory costs nothing
    device = resolve_device(cfg.resources.device)  # the device checks come before models are built or loaded
    check_device_settings(cfg, device)
    check_gpu_request(cfg, device, cuda_device_count(), ray.is_initialized())
    setup = prepare(cfg, log)
    check_lora_targets(setup.paths["student"], cfg.model.lora.target_modules)
    check_tracking(cfg.tracking.wandb_mode)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (run_files or {}).items():  # written only now: a refused run leaves the directory as it was
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    if resume is not None:
        for name in ("metrics.jsonl", "samples.jsonl"):  # the steps after it are done again
            trim_metrics(run_dir / name, resume.step)
    objective = build_objective(cfg.objective)
    started_ray = start_ray(cfg, log)
    tracker, actors, pg, status = None, {}, None, {"status": "failed"}
    try:
        actors, pg = build_actors(cfg, setup, objective)
        log(f"[miniverl] actors ready on {setup.device} ({time.perf_counter() - started:.1f}s since start)")
        start, first = 0, None
        if resume is not None:
            # The rollout side is not loaded here: the loop's first refresh publishes the restored policy
            # and proves the engines serve it (strict sync), exactly as after any update.
            restored = call_all(actors["learner"], "load_checkpoint", [(str(resume.path),)] * len(actors["learner"]))
            log(f"[miniverl] resumed from {resume.path}: step {resume.step}, policy {restored[0].short()}")
            start, first = resume.step, resume.first_eval
        controller = StrictSyncController(
            actors["rollout"],
            actors["scorer"],
            actors["learner"],
            setup.reward_fn,
            objective.teacher_support_k,
            objective.loss_temperature,
            routing=setup.routing,
            staleness=cfg.trainer.staleness,
        )
        params = SamplingParams.from_config(cfg.rollout, setup.stop_token_ids)
        names = (cfg.objective.name, cfg.rollout.backend)
        gate_seed = sampling_seed(cfg.rollout.seed, "gate", 0)
        gate = conformance_gate(controller, setup.eval_batch, params, objective, names, log, gate_seed)
        tr, t = cfg.tracking, cfg.trainer
        tracker = Tracker(
            run_dir, config_dict, tr.wandb_mode, tr.project, tr.run_name, t.total_steps, tr.progress_bar, start
        )
        meta = {"config": typed_config, "config_hash": identity_hash(typed_config), "miniverl_version": version()}
        with StopRequests() as stop:
            loop = TrainingLoop(
                cfg,
                setup,
                controller,
                actors,
                tracker,
                run_dir,
                meta,
                stop,
                RunGauges(),
                after_step,
                str(resume.path) if resume else None,
            )
            try:
                result = loop.run(start, first)
            except RunInterrupted:
                status = {"status": "interrupted", "checkpoint": loop.checkpoint}
                raise
        memory = {
            name if len(group) == 1 else f"{name}{i}": call(a, "memory")
            for name, group in actors.items()
            for i, a in enumerate(group)
        }
        summary = {
            "status": "finished",
            "steps": t.total_steps,
            "resumed_from": str(resume.path) if resume else None,
            "objective": cfg.objective.name,
            "rollout_backend": cfg.rollout.backend,
            "device": setup.device,
            "start_reverse_kl": result.first_eval["eval/reverse_kl"],
            "end_reverse_kl": result.last_eval["eval/reverse_kl"],
            "start_accuracy": result.first_eval["eval/accuracy"],
            "end_accuracy": result.last_eval["eval/accuracy"],
            "by_source": summary_by_source(result.first_eval, result.last_eval),
            "teachers": {teacher_name(r): setup.paths[r] for r in teacher_specs(cfg.model)},
            "wall_seconds": time.perf_counter() - started,
            "checkpoint": result.checkpoint,
            "metrics_file": str(tracker.metrics_path),
            "overlong_prompts_filtered": setup.prompts.overlong_count,
            "memory": memory,
            "conformance": gate,
        }
        status = summary
        return summary
    except MiniVerlError as e:
        status.setdefault("error", str(e).strip().splitlines()[0])
        raise
    finally:
        if tracker is not None:
            tracker.finish(status)
            if cfg.tracking.plots:
                write_plots(tracker.metrics_path, run_dir, log)
        if started_ray:
            ray.shutdown()
        else:
            teardown(actors, pg)


def version() -> str:
    """The installed miniverl version (recorded in checkpoints)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("miniverl")
    except PackageNotFoundError:
        return "unknown (not installed)"
