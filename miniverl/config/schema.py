"""The whole config as one dataclass, registered with Hydra's ConfigStore, and the composed config typed back into it
(unknown keys refused even when added with `+`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config.data import DataConfig
from miniverl.config.model import ModelConfig
from miniverl.config.objective import OBJECTIVE_CONFIGS, GkdObjectiveConfig, ObjectiveConfig, foreign_objective_key
from miniverl.config.resources import ResourcesConfig
from miniverl.config.reward import RewardConfig
from miniverl.config.rollout import RolloutConfig
from miniverl.config.tracking import TrackingConfig
from miniverl.config.trainer import TrainerConfig
from miniverl.errors import ConfigError


@dataclass
class MiniVerlConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=GkdObjectiveConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def longest_row(self) -> int:
        """The longest row a step can hold, in tokens: data.max_prompt_length + rollout.max_new_tokens (what the
        engines, micro-batches and scorer forwards are sized for)."""
        return self.data.max_prompt_length + self.rollout.max_new_tokens

    def apply(self, choices: dict) -> None:
        """Set what the run chose where the config left it null or auto (Setup.chosen: values by dotted key, e.g.
        rollout.backend, resources.learner.num_gpus), so the actors run with it."""
        for key, value in choices.items():
            *path, name = key.split(".")
            node = self
            for part in path:
                node = getattr(node, part)
            setattr(node, name, value)


SCHEMA_NAME = "miniverl_schema"


def structured_schema(objective: str | None = None):
    """MiniVerlConfig as an OmegaConf node whose `objective` holds `objective`'s dataclass (None: left to
    the config group to fill, as Hydra's composition does)."""
    from omegaconf import MISSING, OmegaConf

    node = OmegaConf.structured(MiniVerlConfig)
    schema = OBJECTIVE_CONFIGS.get(objective) if objective is not None else None
    node.objective = MISSING if schema is None else OmegaConf.structured(schema)
    return node


def register_configs() -> None:
    """Put the schema and the `objective` group's options in Hydra's ConfigStore (called by main, not at
    import)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=structured_schema())
    for name, schema in OBJECTIVE_CONFIGS.items():
        store.store(group="objective", name=name, node=schema)


def to_config(cfg) -> MiniVerlConfig:
    """The composed Hydra config as dataclasses; unknown keys are errors even when added with `+`.

    Hydra's `+key=value` force-adds a key past the schema's struct flag, so the key set of every
    structured node is compared with its dataclass fields here.
    """
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    def check(node: DictConfig, where: str) -> None:
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema):
            known = {f.name for f in dataclasses.fields(schema)}
            unknown = sorted(set(node.keys()) - known)
            foreign = foreign_objective_key(node.name, unknown[0]) if unknown and where == "objective." else None
            if foreign:
                raise ConfigError(foreign)
            if unknown:
                owner = where.rstrip(".") or "the root"
                raise ConfigError(f"unknown config key {where}{unknown[0]}; {owner} has: {', '.join(sorted(known))}")
        for key in node:
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                check(child, f"{where}{key}.")

    check(cfg, "")
    return OmegaConf.to_object(cfg)
