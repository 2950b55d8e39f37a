"""The reward section: which deterministic task reward scores the rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewardConfig:
    # auto: chosen per row by data_source (miniverl.rewards.SOURCE_REWARDS: gsm8k sources -> gsm8k, math
    # sources -> boxed, built-in tasks -> exact_match); or one name of miniverl.rewards.REWARDS for all rows.
    name: str = "auto"
    by_source: dict[str, str] = field(default_factory=dict)  # data_source -> reward name, before auto
    custom_function: str | None = None  # path/to/file.py:name, called as fn(data_source, response, ground_truth,
    # extra_info) on decoded text; overrides name and by_source

    def check(self) -> None:
        """The reward names exist. miniverl/rewards owns this check, and it also looks for custom_function's
        file: the one check of a section that reads the disk (parsing and finding the file are one function)."""
        from miniverl.rewards import check_reward_config

        check_reward_config(self)
