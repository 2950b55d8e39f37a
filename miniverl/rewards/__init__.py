"""Task rewards: text scorers chosen per row by its verl `data_source`, or a user's function.

`REWARDS` names the text scorers; `SOURCE_REWARDS` is the `reward.name=auto` table (as verl's
default_compute_score routes by data_source). `build_reward` turns the reward config into the batch
function the controller calls: RolloutBatch -> one score per row.
"""

from __future__ import annotations

from miniverl.data.tasks import CHAT_TASKS, TASKS
from miniverl.registry import Registry
from miniverl.rewards.batch import (
    ExactMatchReward,
    RewardError,
    SourceReward,
    check_custom_signature,
    load_custom_function,
)
from miniverl.rewards.scoring import boxed, exact_match, gsm8k, numeric

REWARDS = Registry("reward", "reward.name")
REWARDS.register("exact_match", exact_match)
REWARDS.register("gsm8k", gsm8k)
REWARDS.register("boxed", boxed)
REWARDS.register("numeric", numeric)  # the final number of a free-form answer (#### n, \\boxed{n}, or the last one)

AUTO = "auto"
# data_source -> reward for reward.name=auto. The hub names are the ones verl's data preprocessors write.
SOURCE_REWARDS = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "boxed",
    "DigitalLearningGmbH/MATH-lighteval": "boxed",
    "HuggingFaceH4/MATH-500": "boxed",
    "math": "boxed",
    "jsonl": "exact_match",  # data.default_data_source of plain jsonl rows
    **{task: "numeric" if task in CHAT_TASKS else "exact_match" for task in TASKS.names()},
}

__all__ = [
    "AUTO",
    "REWARDS",
    "SOURCE_REWARDS",
    "ExactMatchReward",
    "RewardError",
    "SourceReward",
    "build_reward",
    "check_reward_config",
]


def check_reward_config(cfg) -> None:
    """Names exist and a custom function's file exists; loading it waits for build_reward."""
    from miniverl.errors import ConfigError

    if cfg.name != AUTO:
        REWARDS.require(cfg.name)
    for source, name in cfg.by_source.items():
        if name not in REWARDS:
            raise ConfigError(
                f"reward.by_source.{source}={name!r} is not a reward; known: {', '.join(REWARDS.names())}"
            )
    if cfg.custom_function is not None:
        load_custom_function(cfg.custom_function, check_only=True)


def build_reward(cfg, tokenizer) -> SourceReward:
    """The batch reward from RewardConfig: custom function > by_source > name (auto: SOURCE_REWARDS)."""
    if cfg.custom_function is not None:
        fn = load_custom_function(cfg.custom_function)
        check_custom_signature(fn, cfg.custom_function)  # now, before Ray, not at the first scored row
        return SourceReward(tokenizer, lambda source: (cfg.custom_function, fn), custom=True)
    table = {**(SOURCE_REWARDS if cfg.name == AUTO else {}), **cfg.by_source}

    def pick(source: str):
        name = table.get(source, None if cfg.name == AUTO else cfg.name)
        if name is None:
            raise RewardError(
                f"no reward for data_source {source!r} (reward.name=auto knows: {', '.join(sorted(table))});"
                f" set reward.name=<{'|'.join(REWARDS.names())}>, add '+reward.by_source={{{source}: <reward>}}',"
                " or reward.custom_function=path/to/file.py:name"
            )
        return name, REWARDS.get(name)

    return SourceReward(tokenizer, pick)
