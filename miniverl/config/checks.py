"""validate: each section's own checks in the order a user would fix them, then the checks that combine sections, then
the files the config names."""

from __future__ import annotations

from pathlib import Path

from miniverl.config.base import require
from miniverl.config.data import DataConfig
from miniverl.config.objective import ObjectiveConfig, PgK1ObjectiveConfig
from miniverl.config.rollout import RolloutConfig, check_quantized_rollout
from miniverl.config.schema import MiniVerlConfig
from miniverl.data.files import check_paths


def validate(cfg: MiniVerlConfig) -> None:
    """Every check of the config that runs before any model is loaded or actor started: each section's own
    values, in the order a user would fix them (what data, which models, how they sample and learn, where they
    run), then the checks that combine sections, then the files the config names."""
    check_values(cfg)
    check_files(cfg)


def check_values(cfg: MiniVerlConfig) -> None:
    """validate without the files: each section's own values, then their combinations (`python -m miniverl.fit`
    plans a run whose prompt files are elsewhere)."""
    sections = (cfg.data, cfg.model, cfg.rollout, cfg.objective, cfg.reward, cfg.trainer, cfg.resources, cfg.tracking)
    for section in sections:
        section.check()
    check_combinations(cfg)


def check_combinations(cfg: MiniVerlConfig) -> None:
    """The checks that read more than one section (each section's own values are checked already)."""
    t, d, r, res = cfg.trainer, cfg.data, cfg.rollout, cfg.resources
    student = cfg.model.student
    check_loss_weights(t.loss_weight_by_source, d)
    check_quantized_rollout(student.quantization, r.backend, r.vllm.refresh)
    longest = cfg.longest_row
    require(
        t.max_tokens_per_micro_batch == 0 or t.max_tokens_per_micro_batch >= longest,
        f"trainer.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch}: below the longest possible row"
        f" (data.max_prompt_length {d.max_prompt_length} + rollout.max_new_tokens {r.max_new_tokens} = {longest}"
        f" tokens); use 0 (micro_batch_size rows) or at least {longest}",
    )
    check_objective(cfg.objective, r)
    if cfg.model.teacher_is_self:
        require(
            res.scorer_gpus == 0 and not res.scorer.num_gpus,
            f"model.teacher.path=self scores in the learner, so no scorer actor starts, but"
            f" resources.scorer_gpus={res.scorer_gpus} and resources.scorer.num_gpus={res.scorer.num_gpus} give it"
            " GPU; set resources.scorer.num_gpus=0 and resources.scorer_gpus=0 (recipes such as gkd_4080 set a share),"
            " and give the learner what the scorer had if you want it (resources.learner.num_gpus)",
        )
    g = res.gpus
    require(
        g is None or d.prompts_per_step >= max(1, g),
        f"data.prompts_per_step={d.prompts_per_step} < resources.gpus={g}: every learner rank needs a prompt group",
    )
    require(
        not (res.colocate and r.backend == "sglang"),
        "resources.colocate=true with rollout=sglang: SGLang runs its scheduler in processes of its own, so it cannot"
        " share the learner's; use rollout=hf_cached (or hf_reference), or resources.colocate=false",
    )
    require(
        not (res.colocate and r.backend == "vllm"),
        "resources.colocate=true with rollout=vllm: vLLM runs its engine in a process of its own, so it cannot"
        " share the learner's; use rollout=hf_cached (or hf_reference), or resources.colocate=false",
    )
    require(
        not (t.compile_layers and student.quantization != "none"),
        f"trainer.compile_layers=true with model.student.quantization={student.quantization}: compiling"
        " bitsandbytes' 4-bit layers has not been tested; set trainer.compile_layers=false (or a bf16 student)",
    )
    if r.backend == "vllm":  # what rollout.vllm needs of the other sections, before Ray starts
        r.vllm.check_batched_tokens(r.engine_rows(d))
        require(
            r.vllm.refresh != "merged" or student.dtype == "float32",
            f"rollout.vllm.refresh=merged with model.student.dtype={student.dtype} (bf16 on a GPU): a"
            " merge W + s*B*A rounded to bf16 drops small updates (at lr 1e-5, 90% of q_proj entries were unchanged"
            " after 7 updates) while the learner applies its adapter unmerged, so the engine would serve another"
            " policy than the one published; use rollout.vllm.refresh=adapter (the default), or"
            " model.student.dtype=float32",
        )


def check_objective(o: ObjectiveConfig, r: RolloutConfig) -> None:
    """What the objective asks of the rollout (its own ranges are its check method's)."""
    if isinstance(o, PgK1ObjectiveConfig):
        # PG-k1's advantage uses the sampler's log-probs of the *untempered* policy: sampling from
        # anything else makes the gradient estimate biased (DESIGN.md).
        require(
            r.temperature == 1.0 and r.top_k == 0 and r.top_p == 1.0,
            "objective pg_k1 samples at temperature 1 with no top-k/top-p; set rollout.temperature=1"
            " rollout.top_k=0 rollout.top_p=1",
        )
        require(
            o.reward_coef == 0 or r.n > 1,
            f"objective.reward_coef={o.reward_coef} with rollout.n=1: every GRPO group would hold one sample and its"
            " raw score would be the advantage; set rollout.n >= 2 (or objective.reward_coef=0)",
        )


def check_loss_weights(weights: dict[str, float], d: DataConfig) -> None:
    """trainer.loss_weight_by_source against the data: with a built-in task every key must be one of its data
    sources (prompt files' sources are known only as the stream reads them, so their keys are not checked). The
    weights' own range is TrainerConfig.check's."""
    from miniverl.data.tasks import task_names

    sources = task_names(d.task)
    for source, weight in weights.items():
        require(
            bool(d.train_files) or source in sources,
            f"trainer.loss_weight_by_source.{source}={weight}: data.task={d.task} has no data_source {source!r}; its"
            f" sources are {', '.join(sources)}",
        )


def check_files(cfg: MiniVerlConfig) -> None:
    """The checks that read the disk: the prompt files exist and are of one format, and model.cache_dir is not a
    file. (A custom reward's file is looked for by RewardConfig.check, in miniverl/rewards.)"""
    d = cfg.data
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        if files:
            check_paths(files, key)  # a missing path, a directory (naming the files in it), mixed formats
    cache = Path(cfg.model.cache_dir).expanduser()
    require(
        not cache.exists() or cache.is_dir(),
        f"model.cache_dir={cfg.model.cache_dir!r} is a file, not a directory; point it at a directory (it is"
        " created when missing), e.g. model.cache_dir=~/.cache/miniverl",
    )
