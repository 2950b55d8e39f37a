"""The built-in tasks' prompt stream: task examples tokenized by the student's tokenizer.

Built-in models are trained on raw task strings, so their tasks' prompts are raw text; a chat task
(data.tasks.CHAT_TASKS) is one user message behind the student's chat template, and may give the teacher
solved demonstrations as earlier turns (data.teacher_demonstrations).
"""

from __future__ import annotations

import random

from miniverl.batches import PromptBatch
from miniverl.data.tasks import CHAT_TASKS, TASKS, Example, draw_examples, task_names
from miniverl.data.templates import check_same_opener, encode_prompt, generation_opener
from miniverl.errors import ConfigError

DEMONSTRATIONS_FIX = (
    "use a tokenizer whose template ends every prompt with the same assistant opener, or data.teacher_demonstrations=0"
)


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


def demonstration_messages(demos: list[Example], question: str) -> list[dict[str, str]]:
    """A chat whose earlier turns solve `demos` (user: the problem, assistant: its worked solution), then asks
    `question`: the teacher's privileged context."""
    turns = []
    for ex in demos:
        turns += [{"role": "user", "content": ex.prompt}, {"role": "assistant", "content": ex.solution or ex.answer}]
    return [*turns, {"role": "user", "content": question}]


class PromptSource:
    """Deterministic prompt groups: `batch(step, g)` is the same for the same seed and step."""

    def __init__(
        self,
        task: str,
        min_len: int,
        max_len: int,
        tokenizer,
        max_prompt_length: int,
        seed: int,
        held_out: int = 0,
        teacher_demonstrations: int = 0,
    ) -> None:
        """`held_out`: how many evaluation prompts (data.eval_prompts) training draws must never repeat.
        `teacher_demonstrations` (chat tasks): solved examples in each row's teacher prompt."""
        self.name = task
        for name in task_names(task):  # a mixture (reverse+sort) draws its tasks in turn: data_source per row
            TASKS.require(name)
        self.chat = all(name in CHAT_TASKS for name in task_names(task))
        if teacher_demonstrations and not self.chat:
            raise ConfigError(
                f"data.teacher_demonstrations={teacher_demonstrations} needs a chat task (data.task=addition_chat);"
                f" data.task={task} is raw text for the built-in models"
            )
        self.demonstrations = teacher_demonstrations
        self.opener = generation_opener(tokenizer) if self.chat else []
        self.overlong_count = 0  # an over-long built-in prompt is always an error (the task is the fix)
        self.min_len, self.max_len = min_len, max_len
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.seed = seed
        self.held_out = held_out_prompts(task, min_len, max_len, seed, held_out)  # drawn once, not every step

    def _encode(self, messages: list[dict[str, str]], what: str) -> list[int]:
        """Ids of a chat task's `messages` behind the chat template, or of the one message's raw text."""
        tokens = (
            encode_prompt(self.tokenizer, messages, True)
            if self.chat
            else self.tokenizer(messages[0]["content"])["input_ids"]
        )
        if len(tokens) > self.max_prompt_length:
            more = f"data.teacher_demonstrations={self.demonstrations}, " if what.startswith("the teacher") else ""
            raise ConfigError(
                f"{what} has {len(tokens)} tokens, more than data.max_prompt_length={self.max_prompt_length}; raise"
                f" data.max_prompt_length to at least {len(tokens)} or shorten it ({more}data.max_len={self.max_len})"
            )
        return tokens

    def _make(self, examples: list, prefix: str, demo_rng: random.Random) -> PromptBatch:
        ids, uids, answers, sources, teacher = [], [], [], [], []
        for i, (source, ex) in enumerate(examples):
            question = [{"role": "user", "content": ex.prompt}]
            ids.append(self._encode(question, f"prompt {prefix}-{i} ({ex.prompt!r})"))
            uids.append(f"{prefix}-{i}")
            answers.append(ex.answer)
            sources.append(source)
            if self.demonstrations:
                demos = [d for _, d in self._demos(demo_rng, ex)]
                shown = demonstration_messages(demos, ex.prompt)
                teacher.append(self._encode(shown, f"the teacher prompt of {prefix}-{i}"))
                check_same_opener(ids[-1], teacher[-1], self.opener, f"row {prefix}-{i}", DEMONSTRATIONS_FIX)
        return PromptBatch(ids, uids, answers, sources, teacher_prompt_ids=teacher or None)

    def _demos(self, rng: random.Random, row: Example) -> list:
        """The solved examples shown to the teacher beside `row`: never a held-out problem, never the row itself."""
        exclude = self.held_out | {row.prompt}
        return draw_examples(self.name, rng, self.min_len, self.max_len, self.demonstrations, exclude)

    def describe(self) -> str:
        if not self.chat:
            return f"built-in task {self.name!r} ({self.min_len}-{self.max_len} characters, raw text)"
        demos = f", {self.demonstrations} solved demonstrations in the teacher's prompt" if self.demonstrations else ""
        return f"built-in chat task {self.name!r} ({self.min_len}-{self.max_len} digits, chat template{demos})"

    def batch(self, step: int, groups: int) -> PromptBatch:
        task = (self.name, self.min_len, self.max_len, self.seed)
        examples = training_examples(*task, step, groups, self.held_out)
        return self._make(examples, f"s{step}", prompt_rng(self.seed, "demos", step))

    def eval_batch(self, count: int) -> PromptBatch:
        examples = held_out_examples(self.name, self.min_len, self.max_len, self.seed, count)
        return self._make(examples, "eval", prompt_rng(self.seed, "eval-demos"))
