"""Every default of the product, as structured-config dataclasses registered with Hydra's ConfigStore.

YAML files under conf/ only select and override; a key that is not a field here, or a value of the
wrong type, fails in Hydra before anything starts. What types cannot express, each section checks in its
own `check` method, under its fields (ranges, names); `validate` runs those, then the checks that combine
sections, then the files the config names, and every refusal names the fix. One module per section (data, model,
rollout, objective, reward, trainer, resources, tracking), the whole config in schema.py, validate in checks.py;
everything is imported from here.
"""

from __future__ import annotations

from miniverl.config.checks import (
    check_combinations,
    check_files,
    check_loss_weights,
    check_objective,
    check_values,
    validate,
)
from miniverl.config.data import OVERLONG_POLICIES, DataConfig
from miniverl.config.model import LoraConfig, ModelConfig, ModelSpec
from miniverl.config.objective import (
    OBJECTIVE_CONFIGS,
    GkdObjectiveConfig,
    ObjectiveConfig,
    PgK1ObjectiveConfig,
    foreign_objective_key,
)
from miniverl.config.resources import UNPLANNED_SHARES, WEIGHT_SYNC, ActorResources, ResourcesConfig
from miniverl.config.reward import RewardConfig
from miniverl.config.rollout import (
    AUTO_BACKEND,
    REFRESH_MODES,
    RolloutConfig,
    SglangRolloutConfig,
    VllmRolloutConfig,
    check_quantized_rollout,
)
from miniverl.config.schema import SCHEMA_NAME, MiniVerlConfig, register_configs, structured_schema, to_config
from miniverl.config.tracking import TrackingConfig
from miniverl.config.trainer import NONFINITE_POLICIES, PROBE_EVERY, STALENESS_LEVELS, TrainerConfig

__all__ = [
    "AUTO_BACKEND",
    "NONFINITE_POLICIES",
    "OBJECTIVE_CONFIGS",
    "OVERLONG_POLICIES",
    "PROBE_EVERY",
    "REFRESH_MODES",
    "SCHEMA_NAME",
    "STALENESS_LEVELS",
    "UNPLANNED_SHARES",
    "WEIGHT_SYNC",
    "ActorResources",
    "DataConfig",
    "GkdObjectiveConfig",
    "LoraConfig",
    "MiniVerlConfig",
    "ModelConfig",
    "ModelSpec",
    "ObjectiveConfig",
    "PgK1ObjectiveConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "SglangRolloutConfig",
    "TrackingConfig",
    "TrainerConfig",
    "VllmRolloutConfig",
    "check_combinations",
    "check_files",
    "check_loss_weights",
    "check_objective",
    "check_quantized_rollout",
    "check_values",
    "foreign_objective_key",
    "register_configs",
    "structured_schema",
    "to_config",
    "validate",
]
