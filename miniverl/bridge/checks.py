"""The reasons verl 0.9 cannot reproduce a run: one small function each, of the run, returning a reason
(the setting, what verl 0.9 does instead, the fix) or None. `CHECKS` is their order in a refusal."""

from __future__ import annotations

from collections.abc import Callable

from miniverl.bridge import rewards
from miniverl.bridge.spec import RunSpec
from miniverl.bridge.versions import unsupported_verl_version

VERL_ROLLOUT_ENGINES = ("vllm", "sglang")  # verl 0.9 rollout.name values that serve LoRA students
# vLLM's largest LoRA rank (verl's fallback list in vllm_rollout/utils.get_vllm_max_lora_rank).
VLLM_MAX_LORA_RANK = 512


def _verl_version(s: RunSpec) -> str | None:
    return unsupported_verl_version(s.verl_version)


def _rollout_backend(s: RunSpec) -> str | None:
    b = s.cfg.rollout.backend
    if b in VERL_ROLLOUT_ENGINES:
        return None
    return (
        f"rollout.backend={b}: verl 0.9 samples with vLLM or SGLang only (rollout.name), so its samples would not"
        f" come from the sampler this run used; run with rollout.backend=vllm (or sglang)"
    )


def _quantized_student(s: RunSpec) -> str | None:
    q = s.student_quantization
    if q in (None, "", "none"):
        return None
    return (
        f"model.student.quantization={q}: verl 0.9's FSDP actor trains a bf16/fp32 base (no NF4/QLoRA), and a"
        f" learner on another base than the sampler's is off-policy (DESIGN.md); set model.student.quantization=none"
    )


def _teacher_colocated(s: RunSpec) -> str | None:
    if s.cfg.resources.scorer_gpus > 0:
        return None
    return (
        "resources.scorer_gpus=0 puts the teacher on the rollout/learner GPU; verl 0.9 runs the teacher in its own"
        " resource pool (distillation.n_gpus_per_node x nnodes, separate from trainer.n_gpus_per_node); give it"
        " whole GPUs with resources.scorer_gpus=1"
    )


def _multi_teacher(s: RunSpec) -> str | None:
    m = s.cfg.model
    if not m.teachers:
        return None
    # verl 0.9.1 does have multi-teacher distillation (distillation.teacher_models.<entry>.key, routed by
    # distillation.teacher_key=data_source), but with other semantics than miniVERL's: one data_source per
    # entry (a teacher serving two sources is two entries, two servers), no default teacher (an unmatched
    # row raises), and every entry its own whole-GPU replicas summing to the teacher pool.
    return (
        f"model.teachers ({', '.join(sorted(m.teachers))}): a multi-teacher run is not exported. verl 0.9.1 routes"
        " by data_source too (distillation.teacher_models.<entry>.key), but one source per entry, with no default"
        " teacher and each teacher on GPUs of its own, and this bridge does not translate the routing yet;"
        " export a single-teacher run (model.teachers empty, model.teacher.path=...), one per teacher if needed"
    )


def _no_gpus(s: RunSpec) -> str | None:
    if s.cfg.resources.gpus != 0:
        return None
    return "resources.gpus=0 is a CPU-only run; verl 0.9 trains on GPUs; set resources.gpus=1 (or null)"


def _gkd_loss(s: RunSpec) -> str | None:
    o = s.cfg.objective
    if o.name != "gkd" or o.beta == 0.0:
        return None
    return (
        f"objective gkd with beta={o.beta}: verl 0.9's distillation losses are forward_kl_topk (forward KL) and the"
        " sampled-token estimators k1/k2/k3/abs (distillation.distillation_loss.loss_mode); it has no generalized"
        " JSD and no reverse KL over the distribution. Use objective.beta=0 (forward KL), or objective=pg_k1"
        " (verl loss_mode=k1 with use_policy_gradient=true)"
    )


def _gkd_support(s: RunSpec) -> str | None:
    o = s.cfg.objective
    if o.name != "gkd" or o.beta != 0.0:
        return None
    if o.teacher_topk > 0:
        return (
            f"objective.teacher_topk={o.teacher_topk}: verl's forward_kl_topk sums over the teacher's top-k only and"
            " drops the tail mass, which miniVERL keeps as one bucket; set objective.teacher_topk=0 (the full"
            " vocabulary, exported as a top-k over every token)"
        )
    if s.student_vocab_size is None:
        return (
            f"model.student.path={s.cfg.model.student.path}: the full-vocabulary GKD support is exported as"
            " forward_kl_topk with topk = vocabulary size, which is read from the student's config.json; build the"
            " model first (python scripts/build_models.py) or point model.student.path at a local directory"
        )
    return None


def _gkd_temperature(s: RunSpec) -> str | None:
    o, r = s.cfg.objective, s.cfg.rollout
    if o.name != "gkd" or (o.loss_temperature == 1.0 and r.temperature == 1.0):
        return None
    return (
        f"objective.loss_temperature={o.loss_temperature}, rollout.temperature={r.temperature}: verl 0.9 scores the"
        " teacher at the rollout temperature and has no separate loss temperature; set both to 1"
    )


def _pg_discount(s: RunSpec) -> str | None:
    o = s.cfg.objective
    if o.name != "pg_k1" or o.discount == 0.0:
        return None
    return (
        f"objective.discount={o.discount}: verl 0.9's policy-gradient distillation uses the per-token k1 reward as"
        " the advantage (no discounted return); set objective.discount=0"
    )


def _pg_kl_in_advantage(s: RunSpec) -> str | None:
    o = s.cfg.objective
    if o.name != "pg_k1" or o.kl_coef == 0.0:
        return None
    return (
        f"objective.kl_coef={o.kl_coef}: miniVERL subtracts the reference KL from every token's k1 advantage; verl"
        " 0.9 folds it into the task reward before GRPO normalization (algorithm.use_kl_in_reward) or adds a KL"
        " loss (actor.use_kl_loss), neither of which is the same gradient; set objective.kl_coef=0"
    )


def _pg_reward_weight(s: RunSpec) -> str | None:
    o = s.cfg.objective
    if o.name != "pg_k1" or o.reward_coef in (0.0, 1.0):
        return None
    return (
        f"objective.reward_coef={o.reward_coef}: verl 0.9 adds the task-reward policy loss with weight 1 to the"
        " distillation loss (distillation_loss_coef scales the other side, and with it the gradient clipping);"
        " only reward_coef 0 (no task reward) or 1 carry over exactly; set objective.reward_coef=1 or 0"
    )


def _pg_teacher_weight(s: RunSpec) -> str | None:
    o = s.cfg.objective
    if o.name != "pg_k1" or o.teacher_coef == 1.0:
        return None
    return (
        f"objective.teacher_coef={o.teacher_coef}: verl 0.9 weighs the teacher's distillation loss by"
        " distillation_loss_coef, which also scales its gradient clipping, not the k1 advantage alone; set"
        " objective.teacher_coef=1 (for GRPO without a teacher, export a verl GRPO run of its own)"
    )


def _teacher_context(s: RunSpec) -> str | None:
    k = s.cfg.data.teacher_demonstrations
    if k == 0:
        return None
    return (
        f"data.teacher_demonstrations={k}: the teacher scores a prompt of its own (solved demonstrations the student"
        " does not see), and verl 0.9.1's teacher scores the student's prompt; set data.teacher_demonstrations=0"
    )


def _teacher_self(s: RunSpec) -> str | None:
    if not s.cfg.model.teacher_is_self:
        return None
    return (
        "model.teacher.path=self: the teacher is the student's base with its adapter disabled, scored in the learner;"
        " verl 0.9.1's distillation loads a teacher model of its own in its own pool; set model.teacher.path to the"
        " student's model (the same weights, loaded as a separate teacher)"
    )


def _staleness(s: RunSpec) -> str | None:
    lag = s.cfg.trainer.staleness
    if lag == 0:
        return None
    # Read in the verl 0.9.1 wheel: verl/experimental/one_step_off_policy is its one-step-off setting, but as a
    # separate entry point (python -m verl.experimental.one_step_off_policy.main_ppo) whose trainer builds its
    # rollout manager without a teacher client and never starts the teacher pool, and which needs the rollout on
    # GPUs of its own (hybrid_engine=false, rollout.n_gpus_per_node). fully_async_policy bounds staleness by a
    # fraction of samples (async_training.staleness_threshold), not by policy versions.
    return (
        f"trainer.staleness={lag}: verl 0.9.1's one-step-off-policy trainer (verl.experimental.one_step_off_policy,"
        " its own entry point) runs PPO without distillation: it starts no teacher and hands its rollouts no"
        " teacher client, so the distillation losses are not computed there, and it needs the rollout on GPUs of"
        " its own (actor_rollout_ref.hybrid_engine=false); export with trainer.staleness=0 (verl's main_ppo is"
        " synchronous)"
    )


def _lora(s: RunSpec) -> str | None:
    lora = s.cfg.model.lora
    problems = []
    if lora.dropout != 0.0:
        problems.append(f"model.lora.dropout={lora.dropout} (verl's FSDP LoRA has no dropout: set 0)")
    if lora.alpha != int(lora.alpha):
        problems.append(f"model.lora.alpha={lora.alpha} (verl's lora_alpha is an integer: round it)")
    if lora.rank > VLLM_MAX_LORA_RANK:
        problems.append(f"model.lora.rank={lora.rank} (vLLM serves ranks up to {VLLM_MAX_LORA_RANK})")
    return "LoRA settings verl 0.9 cannot express: " + "; ".join(problems) if problems else None


def _batch_sizes(s: RunSpec) -> str | None:
    c = s.cfg
    gpus = c.resources.gpus or 1
    rows = c.data.prompts_per_step * c.rollout.n
    if rows % gpus:
        return (
            f"data.prompts_per_step x rollout.n = {rows} samples per step do not divide over resources.gpus={gpus};"
            " verl needs an equal share per GPU: change prompts_per_step or n"
        )
    per_gpu = rows // gpus
    if per_gpu % c.trainer.micro_batch_size:
        return (
            f"{per_gpu} samples per GPU per step are not a multiple of trainer.micro_batch_size="
            f"{c.trainer.micro_batch_size}; verl's ppo_micro_batch_size_per_gpu must divide them (miniVERL allows a"
            " short last micro-batch): pick a micro_batch_size that divides it"
        )
    return None


def _stop_token_ids(s: RunSpec) -> str | None:
    ids = list(s.cfg.rollout.stop_token_ids)
    if not ids:
        return None
    return (
        f"rollout.stop_token_ids={ids}: verl 0.9.1's rollout config has no stop-token setting (vLLM stops at the"
        " tokenizer's EOS and the eos_token_id ids of the model's generation_config.json), so its responses would"
        " run past these ids; add them to eos_token_id in the student's generation_config.json (miniVERL and vLLM"
        " both stop there) and drop rollout.stop_token_ids"
    )


def _reward_function(s: RunSpec) -> str | None:
    r = s.cfg.reward
    if r.custom_function is not None:
        return None  # verl calls the user's function itself (reward_signature checks that it can)
    table = rewards.routes(r, s.data_sources)
    missing = [source for source, name in table.items() if name is None]
    if missing:
        return (
            f"data_source {', '.join(map(repr, missing))} of the exported rows has no reward under reward.name="
            f"{r.name} (miniVERL's run would stop on it too), so verl would have nothing to call; set reward.name,"
            " add reward.by_source entries for them, or reward.custom_function=path/to/file.py:name"
        )
    foreign = [f"{source} ({name})" for source, name in table.items() if rewards.scorer(name) is None]
    if foreign:
        return (
            f"the reward of {', '.join(foreign)} is not a scorer of miniverl/rewards/scoring.py, the file the export"
            " carries to verl as its compute_score; write it as reward.custom_function with verl's signature"
        )
    return None


def _reward_signature(s: RunSpec) -> str | None:
    spec = s.cfg.reward.custom_function
    if spec is None:
        return None
    problem = rewards.custom_signature_problem(rewards.load_custom(s.cfg.reward))
    if problem is None:
        return None
    return (
        f"reward.custom_function={spec}: verl 0.9 calls its reward.custom_reward_function by keyword as"
        f" fn(data_source=, solution_str=, ground_truth=, extra_info=), miniVERL by position, but {problem}; name"
        f" its first four parameters {', '.join(rewards.VERL_REWARD_ARGS)} (any further ones with defaults)"
    )


def _prompt_tokens(s: RunSpec) -> str | None:
    student, d = s.cfg.model.student.path, s.cfg.data
    templated = bool(d.train_files) and d.chat_template  # built-in tasks are always raw text (PromptSource)
    if s.prompt_special_tokens is None:
        return (
            f"model.student.path={student}: verl renders prompts through a chat template, and whether it reproduces"
            " the run's prompt tokens is read from the student's tokenizer, which is not a local directory here;"
            " build the model first (python scripts/build_models.py) or pass a local directory"
        )
    if templated:
        if s.student_chat_template:
            return None  # verl applies the tokenizer's own template, as miniVERL does (add_generation_prompt)
        return (
            "data.chat_template=true but the student's tokenizer has no chat template (miniVERL's run would stop"
            " too), so verl could not render the prompts; set data.chat_template=false for raw text prompts"
        )
    if s.prompt_special_tokens in ("none", "bos"):
        return None
    return (
        f"the student's tokenizer {s.prompt_special_tokens} of a plain prompt; verl's chat template can reproduce a"
        " leading BOS only, so its prompt tokens would differ from the run's; use a tokenizer that adds at most a"
        " BOS, or data.chat_template=true with prompt files"
    )


CHECKS: tuple[Callable[[RunSpec], str | None], ...] = (
    _verl_version,
    _rollout_backend,
    _quantized_student,
    _teacher_colocated,
    _multi_teacher,
    _no_gpus,
    _gkd_loss,
    _gkd_support,
    _gkd_temperature,
    _pg_discount,
    _pg_kl_in_advantage,
    _pg_reward_weight,
    _pg_teacher_weight,
    _teacher_context,
    _teacher_self,
    _staleness,
    _lora,
    _batch_sizes,
    _stop_token_ids,
    _reward_function,
    _reward_signature,
    _prompt_tokens,
)
