"""A miniVERL run as overrides of verl 0.9.1's `main_ppo` config (verl/trainer/config/ppo_trainer.yaml).

Every key below exists in that release's composed config (tests/bridge compose them with verl's own Hydra
config and run its validation). Only runs that passed `refusals.refusal_reasons` are translated, so each
value carries miniVERL's meaning over; docs/bridge.md lists the correspondences and the few differences
that remain.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from miniverl.bridge.rewards import function_name
from miniverl.bridge.spec import RunSpec

# miniVERL tokenizes a built-in task's prompt, and a file's with data.chat_template=false, as it is
# (`tokenizer(text)`: the text plus a BOS where the tokenizer adds one); verl renders the chat messages
# through a chat template and adds no special tokens of its own. These templates render the one user
# message as its bare content, after the BOS when the run's tokenizer adds one, so verl's prompt tokens are
# the run's. With prompt files and data.chat_template=true both apply the tokenizer's own template with the
# generation prompt, so none is set (both checked by verl's RLHFDataset and chat-template code in tests/bridge).
RAW_PROMPT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
BOS_PROMPT_TEMPLATE = "{{ bos_token }}" + RAW_PROMPT_TEMPLATE
REWARD_FILE = "verl_reward.py"
VERL_TOP_K_OFF = -1  # verl's "no top-k" (miniVERL's is 0)
VERL_NEVER = -1  # verl's test_freq / save_freq value for "never"
# verl's vanilla PPO loss clips the ratio to [1 - low, 1 + high]; miniVERL only truncates it from above at
# is_cap, so the lower clip is opened fully (1 - 1 = 0).
NO_LOWER_RATIO_CLIP = 1.0
VERL_ENTRY = "python3 -m verl.trainer.main_ppo"


def verl_overrides(spec: RunSpec, student: str, teacher: str, data_dir: Path, reward_file: Path) -> dict[str, Any]:
    """Dotted verl keys -> values for the run in `spec` (already checked by refusals).

    student/teacher: model directories or hub ids; data_dir holds train.parquet and test.parquet;
    reward_file is the exported verl_reward.py. Paths are absolute so verl can run from anywhere.
    """
    c = spec.cfg
    d, r, o, t, res, lora = c.data, c.rollout, c.objective, c.trainer, c.resources, c.model.lora
    micro = t.micro_batch_size
    ov: dict[str, Any] = {
        # data: the run's prompts in its step order (verl must not reshuffle them)
        "data.train_files": str(data_dir / "train.parquet"),
        "data.val_files": str(data_dir / "test.parquet"),
        "data.train_batch_size": d.prompts_per_step,
        "data.max_prompt_length": d.max_prompt_length,
        "data.max_response_length": r.max_new_tokens,
        "data.shuffle": False,
        "data.seed": d.seed,
        "data.truncation": "error",  # like miniVERL, a prompt over the limit is an error, never cut
        # model and LoRA
        "actor_rollout_ref.model.path": student,
        "actor_rollout_ref.model.custom_chat_template": prompt_template(spec),
        "actor_rollout_ref.model.lora_rank": lora.rank,
        "actor_rollout_ref.model.lora_alpha": int(lora.alpha),
        "actor_rollout_ref.model.target_modules": list(lora.target_modules),
        # actor: one optimizer step per training step over the whole batch (miniVERL's step)
        "actor_rollout_ref.actor.optim.lr": t.lr,
        "actor_rollout_ref.actor.optim.weight_decay": t.weight_decay,
        "actor_rollout_ref.actor.optim.clip_grad": t.max_grad_norm,
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
        "actor_rollout_ref.actor.ppo_mini_batch_size": d.prompts_per_step,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",  # normalized by the step's response tokens
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.use_kl_loss": False,
        # rollout engine and sampling
        "actor_rollout_ref.rollout.name": r.backend,
        "actor_rollout_ref.rollout.n": r.n,
        "actor_rollout_ref.rollout.temperature": r.temperature,
        "actor_rollout_ref.rollout.top_k": r.top_k if r.top_k > 0 else VERL_TOP_K_OFF,
        "actor_rollout_ref.rollout.top_p": r.top_p,
        "actor_rollout_ref.rollout.seed": r.seed,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": micro,
        **token_budget_overrides(t.max_tokens_per_micro_batch),
        # advantages: GRPO on the task reward (no critic); the reference KL stays out of the reward
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": True,
        "algorithm.use_kl_in_reward": False,
        # gkd has no reference-KL penalty: coefficient 0 (the estimator's name is then unused)
        "algorithm.kl_penalty": o.kl_kind if o.name == "pg_k1" else "k1",
        "algorithm.kl_ctrl.kl_coef": o.kl_coef if o.name == "pg_k1" else 0.0,
        # the reward verl calls: the run's scorer for each row's data_source, or the user's function
        "reward.custom_reward_function.path": str(reward_file),
        "reward.custom_reward_function.name": function_name(c.reward),
        # trainer
        "trainer.total_training_steps": t.total_steps,
        "trainer.total_epochs": 1,  # train.parquet holds exactly total_steps batches
        "trainer.n_gpus_per_node": res.gpus or 1,
        "trainer.nnodes": 1,
        "trainer.project_name": c.tracking.project,
        "trainer.experiment_name": c.tracking.run_name or "miniverl",
        "trainer.logger": ["console"] if c.tracking.wandb_mode == "disabled" else ["console", "wandb"],
        "trainer.val_before_train": True,
        "trainer.test_freq": t.eval_every or VERL_NEVER,
        "trainer.save_freq": t.total_steps if t.save_checkpoint else VERL_NEVER,
    }
    if res.rollout.num_gpus:  # null: chosen per run, which a verl config cannot express
        ov["actor_rollout_ref.rollout.gpu_memory_utilization"] = res.rollout.num_gpus
    ov.update(_distillation(spec, teacher))
    return ov


def prompt_template(spec: RunSpec) -> str | None:
    """verl's custom_chat_template for the run's prompts; None = the tokenizer's own template."""
    d = spec.cfg.data
    if d.train_files and d.chat_template:
        return None
    return BOS_PROMPT_TEMPLATE if spec.prompt_special_tokens == "bos" else RAW_PROMPT_TEMPLATE


def _distillation(spec: RunSpec, teacher: str) -> dict[str, Any]:
    """The teacher and loss as verl 0.9 names them (verl/trainer/config/distillation/distillation.yaml)."""
    c = spec.cfg
    o = c.objective
    prefix = "distillation.distillation_loss."
    ov: dict[str, Any] = {
        "distillation.enabled": True,
        # the teacher's own pool: one single-GPU replica per dedicated GPU (resources.scorer_gpus)
        "distillation.n_gpus_per_node": c.resources.scorer_gpus,
        "distillation.nnodes": 1,
        "distillation.teacher_models.teacher_model.model_path": teacher,
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size": 1,
        prefix + "loss_max_clamp": None,  # miniVERL clamps neither the loss nor the log-probs
        prefix + "log_prob_min_clamp": None,
    }
    if o.name == "pg_k1":
        ov.update(
            {
                prefix + "loss_mode": "k1",  # advantage -(log q - log p) = the k1 reward
                prefix + "use_policy_gradient": True,
                prefix + "use_task_rewards": o.reward_coef > 0,
                prefix + "distillation_loss_coef": 1.0,
                prefix + "clip_ratio_low": NO_LOWER_RATIO_CLIP,
                prefix + "clip_ratio_high": o.is_cap - 1.0,
                # the old policy is the sampler, as in miniVERL (ratios q_theta / q_sampler)
                "algorithm.rollout_correction.bypass_mode": True,
                # the task-reward policy loss clips its ratio with the actor's settings: the same bounds
                "actor_rollout_ref.actor.clip_ratio_low": NO_LOWER_RATIO_CLIP,
                "actor_rollout_ref.actor.clip_ratio_high": o.is_cap - 1.0,
            }
        )
    else:  # gkd at beta 0 over the full vocabulary (refusals admit nothing else)
        ov.update(
            {
                prefix + "loss_mode": "forward_kl_topk",
                prefix + "topk": spec.student_vocab_size,
                prefix + "use_policy_gradient": False,
                prefix + "use_task_rewards": False,
            }
        )
    return ov


def hydra_value(value: Any) -> str:
    """`value` in Hydra's override grammar (strings quoted when they hold anything but plain characters)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    s = str(value)
    if s and all(ch.isalnum() or ch in "_-./~:" for ch in s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def command_line(overrides: dict[str, Any], env: dict[str, str] | None = None) -> str:
    """The shell command that runs verl with `overrides` (one override per line)."""
    head = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    args = [shlex.quote(f"{k}={hydra_value(v)}") for k, v in overrides.items()]
    return (head + " " if head else "") + VERL_ENTRY + " \\\n  " + " \\\n  ".join(args) + "\n"


def nested(overrides: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys as a nested mapping (the YAML form of the same overrides)."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The inverse of `nested`."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def token_budget_overrides(max_tokens: int) -> dict[str, Any]:
    """trainer.max_tokens_per_micro_batch as verl's dynamic batch size: micro-batches cut by tokens per GPU in
    the actor, the rollout's and the reference's log-prob passes (0: miniVERL's row micro-batches, exported
    as ppo_micro_batch_size_per_gpu above; a GPU run's self-sized budget is not known before it starts)."""
    if max_tokens <= 0:
        return {}
    return {
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": max_tokens,
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": True,
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": max_tokens,
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": True,
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": max_tokens,
    }
