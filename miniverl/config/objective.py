"""The objective sections: one dataclass per objective (the Hydra group `objective`), and the refusal of a key
another objective owns."""

from __future__ import annotations

from dataclasses import dataclass

from miniverl.config.base import require

# objective.signal_floor's default (nats): teacher and student log-probs that differ by rounding alone agree. fp32
# log-softmax values of the same logits, computed in two orders, differ by a few ulps of the normalizer (one ulp is
# 1.9e-6 at 16, 3.8e-6 at 32), and a KV-cached decode drifts from a full forward by more in a deep model. Measured with
# teacher = student on the CPU in fp32 (docs/objectives.md, "A zero signal"): GKD's top-K support (the scorer's and the
# learner's normalizers) at most 1.9e-6 on the shipped student and 3.8e-6 on SmolLM2-135M; the hf_cached sampler's
# sampled-token log-probs against the teacher's at most 5.5e-6 and 1.14e-5. The default is about 10x the largest. A
# token this close carries a JSD of ~1e-9 nats and a k1 reward 1e-4 of a typical one (0.5-4 nats): no signal a step
# could use, but a gradient that Adam would scale up to steps of about the learning rate.
SIGNAL_FLOOR_NATS = 1e-4


@dataclass
class ObjectiveConfig:
    """The `objective` config group: one dataclass per objective below, each holding only its own settings,
    so a key another objective owns (`+experiment=pg_k1 objective.beta=0.9`) fails before Ray instead of
    being ignored. Choose one with `objective=<name>` (or an experiment); `name` only says which it is."""

    name: str = "???"  # a name in miniverl.objectives.OBJECTIVES (set by each objective's dataclass)
    # Per-token teacher-student differences (GKD: every support log-prob and the tail's; PG-k1: the token reward)
    # within this many nats count as 0 signal, with 0 gradient, so teacher = student leaves the adapter as it is.
    # 0 = only exact equality.
    signal_floor: float = SIGNAL_FLOOR_NATS

    def check(self) -> None:
        """The name is a known objective, and this group holds that objective's settings."""
        from miniverl.objectives import OBJECTIVES

        OBJECTIVES.require(self.name)
        require(
            self.signal_floor >= 0,
            f"objective.signal_floor={self.signal_floor}: must be >= 0 nats (0 = only exact agreement counts as no"
            f" signal; the default {SIGNAL_FLOOR_NATS:g} is above fp32 rounding)",
        )
        require(
            type(self) is OBJECTIVE_CONFIGS[self.name],
            f"objective.name={self.name} but the objective group holds {type(self).__name__}'s settings; choose the"
            f" objective with objective={self.name} (or +experiment={self.name}), not objective.name",
        )


@dataclass
class GkdObjectiveConfig(ObjectiveConfig):
    """Direct GKD: generalized JSD per response token against the teacher's support (docs/objectives.md)."""

    name: str = "gkd"
    beta: float = 0.5  # 0 = forward KL(p||q), 1 = reverse KL(q||p), between: generalized JSD
    loss_temperature: float = 1.0  # divides teacher and student logits in the loss; rollout.temperature is separate
    teacher_topk: int = 64  # K teacher tokens plus one tail bucket (a lower bound); 0 = full vocabulary

    def check(self) -> None:
        super().check()
        require(0 <= self.beta <= 1, f"objective.beta={self.beta}: must be in [0, 1]")
        require(self.loss_temperature > 0, f"objective.loss_temperature={self.loss_temperature}: must be > 0")
        require(
            self.teacher_topk >= 0, f"objective.teacher_topk={self.teacher_topk}: use 0 (full vocabulary) or K >= 1"
        )


@dataclass
class PgK1ObjectiveConfig(ObjectiveConfig):
    """PG-k1: policy gradient with the per-token k1 advantage log p_teacher - log q_sampler. Samples at
    temperature 1 with no top-k/top-p (validate enforces it)."""

    name: str = "pg_k1"
    discount: float = 0.0  # gamma of the discounted k1 return (0 = per-token reverse KL, 1 = sequence KL)
    # Truncated importance sampling cap on q_theta / q_sampler (verl: about 2); inf = off, and then the
    # conformance gate refuses a sampler outside PG-k1's tolerance.
    is_cap: float = 2.0
    kl_coef: float = 0.0  # reference-KL penalty folded into the per-token reward (0 = off)
    kl_kind: str = "k1"  # k1|k2|k3 (verl aliases kl|mse|low_var_kl) and abs
    reward_coef: float = 0.0  # weight of the GRPO-normalized task reward added to every token's advantage
    # weight of the teacher's k1 signal log p - log q in the per-token reward; 0 with reward_coef > 0 is GRPO on the
    # task reward alone (the baseline a distillation result is compared with)
    teacher_coef: float = 1.0

    def check(self) -> None:
        """PG-k1's own ranges; what it asks of the rollout is check_objective's."""
        from miniverl.objectives.kl import KL_KINDS

        super().check()
        require(0 <= self.discount <= 1, f"objective.discount={self.discount}: must be in [0, 1]")
        require(self.is_cap >= 1, f"objective.is_cap={self.is_cap}: must be >= 1 (verl uses about 2)")
        require(self.kl_kind in KL_KINDS, f"objective.kl_kind={self.kl_kind!r}: use one of {', '.join(KL_KINDS)}")
        require(self.teacher_coef >= 0, f"objective.teacher_coef={self.teacher_coef}: must be >= 0 (0 = no teacher)")
        require(
            self.teacher_coef > 0 or self.reward_coef > 0,
            "objective.teacher_coef=0 and objective.reward_coef=0 leave PG-k1 no signal; set objective.reward_coef=1"
            " for GRPO on the task reward, or objective.teacher_coef=1 to distil",
        )


OBJECTIVE_CONFIGS: dict[str, type[ObjectiveConfig]] = {"gkd": GkdObjectiveConfig, "pg_k1": PgK1ObjectiveConfig}


def foreign_objective_key(objective: str, key: str) -> str | None:
    """The error for `objective.<key>` under `objective`, or None when that objective owns the key."""
    import dataclasses

    schema = OBJECTIVE_CONFIGS.get(objective)
    if schema is None:
        return None  # an unknown objective name is reported on its own
    own = [f.name for f in dataclasses.fields(schema)]
    if key in own:
        return None
    owners = [n for n, c in OBJECTIVE_CONFIGS.items() if key in {f.name for f in dataclasses.fields(c)}]
    msg = f"objective.{key} is not a setting of objective {objective} (its settings: {', '.join(own)})"
    if owners:
        return (
            f"{msg}; it belongs to objective {owners[0]}. Fix: drop objective.{key}, or train {owners[0]}"
            f" (objective={owners[0]}, or +experiment={owners[0]})"
        )
    return f"{msg}. Fix: check the spelling"
