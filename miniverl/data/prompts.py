"""The built-in tasks' prompt stream: task examples tokenized (raw text) by the student's tokenizer.

Built-in models are trained on raw task strings, so no chat template is applied here.
"""

from __future__ import annotations

import random

from miniverl.batches import PromptBatch
from miniverl.data.tasks import TASKS, draw_examples, task_names
from miniverl.errors import ConfigError


def prompt_rng(seed: int, purpose: str, step: int = 0) -> random.Random:
    """The random stream of one draw of built-in prompts, for (data.seed, purpose "train" or "eval", step). Python
    seeds a str through SHA-512, so no two (seed, purpose, step) share a stream. The former integer scheme did:
    training step s used seed * 7919 + s and the evaluation seed + 1,000,000, so with data.seed=126 training step
    2,332 drew exactly the evaluation prompts (issue 33)."""
    return random.Random(f"miniverl-prompts:{purpose}:{seed}:{step}")


def held_out_examples(task: str, min_len: int, max_len: int, seed: int, count: int) -> list:
    """The evaluation's `count` examples of built-in `task` as (task name, example): the held-out set."""
    return draw_examples(task, prompt_rng(seed, "eval"), min_len, max_len, count)


def held_out_prompts(task: str, min_len: int, max_len: int, seed: int, count: int) -> frozenset[str]:
    """The prompt texts of the first `count` evaluation examples: what training draws never repeat."""
    return frozenset(ex.prompt for _, ex in held_out_examples(task, min_len, max_len, seed, count))


def training_examples(
    task: str, min_len: int, max_len: int, seed: int, step: int, count: int, exclude: frozenset[str]
) -> list:
    """Training step `step`'s `count` examples as (task name, example), never one whose prompt is in `exclude` (the
    held-out prompts, `held_out_prompts`: drawn again, so the stream stays deterministic)."""
    return draw_examples(task, prompt_rng(seed, "train", step), min_len, max_len, count, exclude)


class PromptSource:
    """Deterministic prompt groups: `batch(step, g)` is the same for the same seed and step."""

    def __init__(
        self, task: str, min_len: int, max_len: int, tokenizer, max_prompt_length: int, seed: int, held_out: int = 0
    ) -> None:
        """`held_out`: how many evaluation prompts (data.eval_prompts) training draws must never repeat."""
        self.name = task
        for name in task_names(task):  # a mixture (reverse+sort) draws its tasks in turn: data_source per row
            TASKS.require(name)
        self.overlong_count = 0  # an over-long built-in prompt is always an error (the task is the fix)
        self.min_len, self.max_len = min_len, max_len
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.seed = seed
        self.held_out = held_out_prompts(task, min_len, max_len, seed, held_out)  # drawn once, not every step

    def _make(self, examples: list, prefix: str) -> PromptBatch:
        ids, uids, answers, sources = [], [], [], []
        for i, (source, ex) in enumerate(examples):
            tokens = self.tokenizer(ex.prompt)["input_ids"]
            if len(tokens) > self.max_prompt_length:
                raise ConfigError(
                    f"prompt {prefix}-{i} ({ex.prompt!r}) has {len(tokens)} tokens, more than"
                    f" data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length or"
                    f" shorten the task (data.max_len={self.max_len})"
                )
            ids.append(tokens)
            uids.append(f"{prefix}-{i}")
            answers.append(ex.answer)
            sources.append(source)
        return PromptBatch(ids, uids, answers, sources)

    def describe(self) -> str:
        return f"built-in task {self.name!r} ({self.min_len}-{self.max_len} characters, raw text)"

    def batch(self, step: int, groups: int) -> PromptBatch:
        task = (self.name, self.min_len, self.max_len, self.seed)
        return self._make(training_examples(*task, step, groups, self.held_out), f"s{step}")

    def eval_batch(self, count: int) -> PromptBatch:
        return self._make(held_out_examples(self.name, self.min_len, self.max_len, self.seed, count), "eval")
