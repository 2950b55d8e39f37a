"""Each config section checks its own values in a `check` method under its fields (miniverl/config/<section>.py), and
`validate` runs every one of those checks."""

from __future__ import annotations

import dataclasses
import re

import pytest

from miniverl import config
from miniverl.config import (
    ActorResources,
    DataConfig,
    GkdObjectiveConfig,
    LoraConfig,
    MiniVerlConfig,
    ModelConfig,
    ModelSpec,
    ObjectiveConfig,
    PgK1ObjectiveConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    SglangRolloutConfig,
    TrackingConfig,
    TrainerConfig,
    VllmRolloutConfig,
    validate,
)
from miniverl.errors import ConfigError

# Dataclasses of miniverl.config without a check of their own, and why.
NOT_SECTION_CHECKED = {
    MiniVerlConfig: "validate is its check",
}


def config_dataclasses() -> set[type]:
    return {c for c in vars(config).values() if isinstance(c, type) and dataclasses.is_dataclass(c)}


def own_checks() -> set[type]:
    """The dataclasses of miniverl.config that define a check method themselves (not only inherit one)."""
    return {c for c in config_dataclasses() if "check" in vars(c)}


# (the section whose check refuses, a good instance, the one change that makes it bad, check's arguments, refusal)
CASES = [
    (DataConfig, DataConfig(), {"overlong": "truncate"}, (), "data.overlong='truncate': use filter"),
    (ModelSpec, ModelSpec(), {"dtype": "fp8"}, ("model.student",), "model.student.dtype='fp8': use auto or one of"),
    (LoraConfig, LoraConfig(), {"rank": 0}, (), "model.lora.rank=0: a LoRA adapter needs rank >= 1"),
    (
        ModelConfig,
        ModelConfig(),
        {"builtin_min_teacher_accuracy": 2.0},
        (),
        "model.builtin_min_teacher_accuracy=2.0: must be in [0, 1]",
    ),
    (RolloutConfig, RolloutConfig(), {"n": 0}, (), "rollout.n=0: need at least one sample per prompt"),
    (
        VllmRolloutConfig,
        VllmRolloutConfig(),
        {"max_num_seqs": -1},
        (),
        "rollout.vllm.max_num_seqs=-1: use 0 (derived) or a positive count",
    ),
    (
        SglangRolloutConfig,
        SglangRolloutConfig(),
        {"mem_fraction_static": 1.5},
        (),
        "rollout.sglang.mem_fraction_static=1.5: a fraction of the free memory in (0, 1)",
    ),
    (
        ObjectiveConfig,
        GkdObjectiveConfig(),
        {"name": "pg_k1"},
        (),
        "objective.name=pg_k1 but the objective group holds GkdObjectiveConfig's settings",
    ),
    (GkdObjectiveConfig, GkdObjectiveConfig(), {"beta": 1.5}, (), "objective.beta=1.5: must be in [0, 1]"),
    (PgK1ObjectiveConfig, PgK1ObjectiveConfig(), {"kl_kind": "k4"}, (), "objective.kl_kind='k4': use one of"),
    (PgK1ObjectiveConfig, PgK1ObjectiveConfig(), {"signal_floor": -1e-5}, (), "objective.signal_floor=-1e-05: must"),
    (RewardConfig, RewardConfig(), {"name": "fuzzy"}, (), "unknown reward 'fuzzy'"),
    (TrainerConfig, TrainerConfig(), {"total_steps": 0}, (), "trainer.total_steps=0: need at least 1 step"),
    (
        ActorResources,
        ActorResources(),
        {"num_cpus": -1.0},
        ("resources.scorer",),
        "resources.scorer: num_gpus (null: chosen) and num_cpus must be >= 0",
    ),
    (ResourcesConfig, ResourcesConfig(), {"weight_sync": "nvlink"}, (), "resources.weight_sync='nvlink': use auto"),
    (TrackingConfig, TrackingConfig(), {"wandb_mode": "maybe"}, (), "tracking.wandb_mode='maybe': use offline"),
]


@pytest.mark.parametrize(("section", "good", "change", "args", "message"), CASES, ids=[c[0].__name__ for c in CASES])
def test_a_section_refuses_a_bad_value_of_its_own_by_itself(section, good, change, args, message):
    """No MiniVerlConfig is built: the section's check alone accepts its good value and refuses the bad one."""
    good.check(*args)
    with pytest.raises(ConfigError, match=re.escape(message)):
        dataclasses.replace(good, **change).check(*args)


def test_every_section_check_has_a_case():
    assert own_checks() == {c[0] for c in CASES}


def test_every_config_dataclass_has_a_check_or_says_why_not():
    unchecked = {c.__name__ for c in config_dataclasses() - set(NOT_SECTION_CHECKED) if not hasattr(c, "check")}
    assert unchecked == set()


class Refused(Exception):
    pass


def valid_configs() -> list[MiniVerlConfig]:
    """One config per objective: an objective's check runs only when the config holds that objective."""
    return [MiniVerlConfig(objective=schema()) for schema in config.OBJECTIVE_CONFIGS.values()]


def test_the_configs_below_are_valid():
    for cfg in valid_configs():
        validate(cfg)


@pytest.mark.parametrize("section", sorted(own_checks(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_validate_runs_the_check_of(section, monkeypatch):
    """validate reaches this section's check (itself or through its parent section's check) and lets its refusal
    through; a check written under a dataclass but never called fails here."""

    def refuse(self, *args):
        raise Refused(section.__name__)

    monkeypatch.setattr(section, "check", refuse)
    refused = []
    for cfg in valid_configs():
        try:
            validate(cfg)
        except Refused:
            refused.append(cfg.objective.name)
    assert refused, f"validate never calls {section.__name__}.check"


# rollout.vllm's own values (VllmRolloutConfig.check): the change to the section, and the refusal.
VLLM_OWN = [
    ({"refresh": "copy"}, "rollout.vllm.refresh='copy': use one of adapter, merged"),
    ({"kv_cache_gib": 0.0}, "rollout.vllm.kv_cache_gib=0.0: use a positive size or null (derived)"),
]


@pytest.mark.parametrize("backend", ["vllm", "hf_cached", "hf_reference"])
@pytest.mark.parametrize(("change", "message"), VLLM_OWN, ids=["+".join(change) for change, _ in VLLM_OWN])
def test_validate_refuses_a_bad_rollout_vllm_value_whatever_the_backend(change, message, backend):
    """Before Ray and on a CPU-only machine: the section's own values are refused whichever backend the run uses, as
    every section's are (its sizes always were; an unused teacher's dtype or resources.rollout.num_gpus on the CPU are
    checked too), so a typo in a recipe never waits for the day it switches to vLLM."""
    cfg = MiniVerlConfig()
    cfg.rollout.backend, cfg.resources.device = backend, "cpu"
    cfg.model.student.dtype = "float32"  # merged refresh is refused in half precision (check_combinations)
    validate(cfg)
    cfg.rollout.vllm = dataclasses.replace(cfg.rollout.vllm, **change)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg)


def test_validate_refuses_fewer_batched_tokens_than_rows_the_vllm_engine_decodes():
    """A vLLM engine step must hold one token of each row it decodes: rollout.vllm.max_num_seqs, or the run's largest
    generate call (a step's G x N rows, or the evaluation's prompts). Other backends have no engine step to size."""
    cfg = MiniVerlConfig()
    cfg.rollout.backend = "vllm"
    cfg.data.prompts_per_step, cfg.rollout.n, cfg.data.eval_prompts = 16, 4, 32  # 64 rows a step
    cfg.rollout.vllm.max_num_batched_tokens = 64
    validate(cfg)
    for key, value, rows in (("max_num_batched_tokens", 63, 64), ("max_num_seqs", 100, 100)):
        setattr(cfg.rollout.vllm, key, value)
        bad = cfg.rollout.vllm.max_num_batched_tokens
        with pytest.raises(
            ConfigError,
            match=re.escape(f"rollout.vllm.max_num_batched_tokens={bad} is below the {rows} rows the engine decodes at")
            + f".*at least {rows}, or 0 for vLLM's default",
        ):
            validate(cfg)
    cfg.rollout.vllm.max_num_seqs, cfg.data.eval_prompts = 0, 128  # the evaluation's call is the largest
    with pytest.raises(ConfigError, match="below the 128 rows"):
        validate(cfg)
    cfg.rollout.vllm.max_num_batched_tokens = 0  # vLLM's default chunk
    validate(cfg)
    cfg.rollout.vllm.max_num_batched_tokens, cfg.rollout.backend = 8, "hf_cached"
    validate(cfg)
