"""The batch side of rewards: decode each row, route it to a text scorer, check what comes back."""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
from collections.abc import Callable
from pathlib import Path

import torch

from miniverl.batches import RolloutBatch
from miniverl.errors import ConfigError, MiniVerlError

# (name shown in errors, function)
Picked = tuple[str, Callable]


class RewardError(MiniVerlError):
    """A reward could not score a row: it raised, returned a non-number, or has no scorer for the row."""


class SourceReward:
    """One score per row: the text scorer chosen by the row's data_source, on the decoded response.

    A response that ran out of tokens without a stop token scores 0: an answer must be finished.
    Built-in scorers are called as fn(response, ground_truth); a custom function (`custom=True`) as
    fn(data_source, response, ground_truth, extra_info), verl's compute_score signature. It may return
    a number or a dict with a numeric "score" (as verl allows).
    """

    def __init__(self, tokenizer, pick: Callable[[str], Picked], custom: bool = False) -> None:
        self.tokenizer = tokenizer
        self.pick = pick
        self.custom = custom

    def check_sources(self, sources: list[str]) -> None:
        """Fail now (not mid-run) when a data_source has no reward."""
        for source in dict.fromkeys(sources):
            self.pick(source)

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:  # [B]
        texts = self.decode(batch)
        scores = []
        for i, (text, done) in enumerate(zip(texts, batch.finished.tolist())):
            source, truth, extra = batch.data_source[i], batch.ground_truth[i], batch.extra_info[i]
            name, fn = self.pick(source)
            scores.append(self._score_row(i, batch.uid[i], source, name, fn, text, truth, extra) if done else 0.0)
        return torch.tensor(scores, dtype=torch.float32)

    def _score_row(self, i, uid, source, name, fn, text, truth, extra) -> float:
        where = f"row {i} (uid {uid}, data_source {source!r}), reward {name}"
        try:
            value = fn(source, text, truth, extra) if self.custom else fn(text, truth)
        except Exception as e:
            raise RewardError(f"{where} raised {e.__class__.__name__}: {e}; fix the function or the row's data") from e
        if isinstance(value, dict) and "score" in value:
            value = value["score"]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardError(f"{where} returned {value!r}; a reward must return a finite number (or {{'score': x}})")
        return float(value)

    def decode(self, batch: RolloutBatch) -> list[str]:
        out = []
        for row, mask in zip(batch.responses.tolist(), batch.response_mask.tolist()):
            ids = [t for t, m in zip(row, mask) if m]
            out.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        return out


class ExactMatchReward(SourceReward):
    """Exact match for every row, whatever its data_source (the built-in tasks)."""

    def __init__(self, tokenizer) -> None:
        from miniverl.rewards.scoring import exact_match

        super().__init__(tokenizer, lambda source: ("exact_match", exact_match))


def load_custom_function(spec: str, check_only: bool = False) -> Callable | None:
    """`path/to/file.py:name` -> the function; errors name reward.custom_function and the fix."""
    path, sep, name = spec.rpartition(":")
    key = f"reward.custom_function={spec!r}"
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"{key}: write it as path/to/file.py:function_name")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{key}: {file} does not exist; pass the path of a Python file (absolute, or from the cwd)")
    if check_only:
        return None
    module_spec = importlib.util.spec_from_file_location(f"miniverl_user_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{key}: importing {file} raised {e.__class__.__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"{key}: {file} defines no function {name!r} (it defines: {', '.join(defined) or 'none'})")
    return fn


CUSTOM_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")  # verl's compute_score arguments


def check_custom_signature(fn: Callable, spec: str) -> None:
    """A custom reward is called as fn(data_source, solution_str, ground_truth, extra_info): check that it
    accepts those four arguments now, before Ray starts, instead of failing at the first scored row."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function without a signature: it is tried when called
        return
    try:
        signature.bind(*CUSTOM_ARGS)
    except TypeError as e:
        raise ConfigError(
            f"reward.custom_function={spec!r}: the function's signature {fn.__name__}{signature} cannot take the"
            f" four arguments it is called with ({e}); define it as def {fn.__name__}({', '.join(CUSTOM_ARGS)})"
        ) from e
