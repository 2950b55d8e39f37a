"""The task reward as verl 0.9 calls it: the run's reward config resolved for each data_source of the
exported rows, written as the one file verl loads as `reward.custom_reward_function`.

verl calls `compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` by
keyword, on the response decoded without special tokens. Built-in scorers: verl's default_compute_score
routes 'openai/gsm8k' and the MATH sources itself, but by other rules (gsm8k: the last '#### ' number in
the last 300 characters, compared as a string, where miniVERL compares numbers; MATH: its own answer
normalization, and an 'Answer:' format for 'math'), so the export carries miniVERL's scorers
(miniverl/rewards/scoring.py, which imports only `math` and `re`) plus a data_source -> scorer table. A
`reward.custom_function` already has verl's signature or is refused; it is copied as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path

from miniverl.rewards import build_reward, scoring
from miniverl.rewards.batch import RewardError, load_custom_function

VERL_REWARD_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")  # verl's keywords, in order
EXPORTED_FUNCTION = "compute_score"  # the function of the exported file for built-in scorers
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def routes(reward_cfg, sources: Iterable[str]) -> dict[str, str | None]:
    """data_source -> the reward name miniVERL's build_reward picks for it (None: it has none)."""
    if reward_cfg.custom_function is not None:
        return {s: reward_cfg.custom_function for s in dict.fromkeys(sources)}
    reward = build_reward(reward_cfg, tokenizer=None)
    out: dict[str, str | None] = {}
    for source in dict.fromkeys(sources):
        try:
            out[source] = reward.pick(source)[0]
        except RewardError:
            out[source] = None
    return out


def scorer(name: str) -> Callable | None:
    """The built-in scorer `name` when it lives in scoring.py (so the export can carry it), else None."""
    fn = scoring.__dict__.get(name)
    return fn if callable(fn) and getattr(fn, "__module__", None) == scoring.__name__ else None


def custom_signature_problem(fn: Callable) -> str | None:
    """Why verl could not call `fn` as miniVERL does (None: it can).

    miniVERL calls it by position, verl by keyword; both land on the same parameters only when its first
    four are named data_source, solution_str, ground_truth, extra_info and nothing else is required.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "its signature cannot be read"
    first = [p for p in sig.parameters.values() if p.kind in POSITIONAL][: len(VERL_REWARD_ARGS)]
    names = tuple(p.name for p in first)
    if names != VERL_REWARD_ARGS or any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in first):
        return f"its parameters are {sig}"
    try:
        sig.bind(**dict.fromkeys(VERL_REWARD_ARGS))
    except TypeError as e:
        return f"called with verl's four keywords it fails ({e})"
    return None


def function_name(reward_cfg) -> str:
    """The function verl is told to call in the exported file."""
    if reward_cfg.custom_function is not None:
        return reward_cfg.custom_function.rpartition(":")[2]
    return EXPORTED_FUNCTION


def load_custom(reward_cfg) -> Callable:
    return load_custom_function(reward_cfg.custom_function)


def reward_file_text(reward_cfg, table: dict[str, str]) -> str:
    """The exported reward file: the user's own file, or scoring.py with a routing table for `table`."""
    if reward_cfg.custom_function is not None:
        return Path(reward_cfg.custom_function.rpartition(":")[0]).expanduser().read_text()
    used = sorted(set(table.values()))
    return (
        Path(scoring.__file__).read_text()
        + "\n\n# Written by miniverl.bridge: the scorer of each data_source of the exported rows, as the run's"
        + " reward config\n# (reward.name, reward.by_source) picks it. verl calls compute_score by keyword.\n"
        + f"ROUTES = {dict(sorted(table.items()))!r}\n"
        + "SCORERS = {"
        + ", ".join(f"{n!r}: {scorer(n).__name__}" for n in used)
        + "}\n\n\n"
        + "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        + '    """The run\'s reward of one decoded response (1.0 right, 0.0 wrong)."""\n'
        + "    if data_source not in ROUTES:\n"
        + "        raise ValueError(\n"
        + '            f"data_source {data_source!r} was not in the exported rows (known: {sorted(ROUTES)});"\n'
        + '            " export the run again with these rows"\n'
        + "        )\n"
        + "    return SCORERS[ROUTES[data_source]](solution_str, ground_truth)\n"
    )
