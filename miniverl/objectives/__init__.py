"""Objectives: pure tensor functions (public API) and the training objectives chosen by name.

Public functions take tensors and plain scalars; only `build_objective` reads config.
"""

from miniverl.objectives.advantages import discounted_returns, grpo_advantages
from miniverl.objectives.aggregation import masked_mean, step_token_mean
from miniverl.objectives.gkd import generalized_jsd, jsd_from_logprobs, topk_generalized_jsd
from miniverl.objectives.interface import Objective, SupportObjective, missing_members
from miniverl.objectives.kl import kl_penalty
from miniverl.objectives.pg_k1 import k1_advantages, pg_k1_loss, truncated_pg_loss
from miniverl.registry import Registry

OBJECTIVES = Registry("objective", "objective.name")
OBJECTIVES.register("gkd", "miniverl.objectives.gkd:GkdObjective")
OBJECTIVES.register("pg_k1", "miniverl.objectives.pg_k1:PgK1Objective")


def build_objective(cfg) -> Objective:
    """The training objective named by `cfg.name`, built from its config section; one that does not meet the
    contract (objectives/interface.py) is refused here, by name, not by an AttributeError mid-step."""
    objective = OBJECTIVES.get(cfg.name).from_config(cfg)
    missing = missing_members(objective)
    if missing:
        raise TypeError(
            f"objective {cfg.name!r} ({type(objective).__name__}) lacks {', '.join(missing)} of the objective"
            " contract (miniverl/objectives/interface.py)"
        )
    return objective


__all__ = [
    "OBJECTIVES",
    "Objective",
    "SupportObjective",
    "build_objective",
    "discounted_returns",
    "generalized_jsd",
    "grpo_advantages",
    "jsd_from_logprobs",
    "k1_advantages",
    "kl_penalty",
    "masked_mean",
    "pg_k1_loss",
    "step_token_mean",
    "topk_generalized_jsd",
    "truncated_pg_loss",
]
