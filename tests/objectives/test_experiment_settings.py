"""The shipped experiment files build the objectives they promise (settings explained in the YAML)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from miniverl.config import register_configs, to_config, validate
from miniverl.objectives import build_objective
from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.pg_k1 import PgK1Objective

CONF = Path(__file__).resolve().parents[2] / "conf"


def load(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def test_pg_k1_experiment_samples_groups_for_grpo_at_temperature_one():
    cfg = load("+experiment=pg_k1")
    validate(cfg)
    objective = build_objective(cfg.objective)
    assert isinstance(objective, PgK1Objective)
    assert (cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p) == (1.0, 0, 1.0)
    # A task reward mixed in through GRPO needs groups of more than one sample: a group of one is not
    # normalized (verl: mean 0, std 1), so its raw 0/1 score would be the advantage.
    assert objective.reward_coef > 0 and cfg.rollout.n >= 2
    assert objective.discount == 0.0 and objective.is_cap == 2.0  # the per-token k1 advantage, verl's cap


def test_gkd_experiment_with_beta_one_is_reverse_kl_on_the_top_k_support():
    cfg = load("+experiment=gkd", "objective.beta=1")
    validate(cfg)
    objective = build_objective(cfg.objective)
    assert isinstance(objective, GkdObjective)
    assert objective.beta == 1.0 and objective.teacher_support_k == cfg.objective.teacher_topk
