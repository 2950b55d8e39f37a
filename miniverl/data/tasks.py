"""Built-in synthetic tasks with exact-match answers. Each is a name in TASKS and a `sample` function."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from miniverl.errors import ConfigError
from miniverl.registry import Registry

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    solution: str = ""  # the worked answer a demonstration shows (chat tasks); "" = the answer itself


class Task(Protocol):
    """Draws one example; `min_len`/`max_len` bound the size of the problem (characters or digits)."""

    def __call__(self, rng: random.Random, min_len: int, max_len: int) -> Example: ...


def reverse_task(rng: random.Random, min_len: int, max_len: int) -> Example:
    """`abc>` -> `cba`: reverse a random lowercase string."""
    s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
    return Example(prompt=f"{s}>", answer=s[::-1])


def addition_task(rng: random.Random, min_len: int, max_len: int) -> Example:
    """`12+345=` -> `357`: add two non-negative integers of min_len..max_len digits."""
    a, b = (rng.randint(0, 10 ** rng.randint(min_len, max_len) - 1) for _ in range(2))
    return Example(prompt=f"{a}+{b}=", answer=str(a + b))


def sort_task(rng: random.Random, min_len: int, max_len: int) -> Example:
    """`cab=` -> `abc`: sort a random lowercase string (letters then `=`; addition's prompts are digits)."""
    s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
    return Example(prompt=f"{s}=", answer="".join(sorted(s)))


def addition_chat_task(rng: random.Random, min_len: int, max_len: int) -> Example:
    """ "What is 27 + 82? Answer with just the number." -> `109`: add two numbers of min_len..max_len digits (no
    leading zeros), asked in words, for an instruct model behind its chat template. The worked form `27 + 82 = 109`
    is what its demonstrations show: SmolLM2-135M-Instruct answered 35/100 with four such demonstrations in its
    context and 0/100 with bare-number ones (DESIGN.md, "one real model")."""
    a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in (rng.randint(min_len, max_len) for _ in range(2)))
    return Example(
        prompt=f"What is {a} + {b}? Answer with just the number.", answer=str(a + b), solution=f"{a} + {b} = {a + b}"
    )


TASKS = Registry("task", "data.task")
TASKS.register("reverse", reverse_task)
TASKS.register("addition", addition_task)
TASKS.register("sort", sort_task)
TASKS.register("addition_chat", addition_chat_task)
# Tasks asked in words of an instruct model: their prompts go through the student's chat template as one user
# message, their answers are scored as numbers (reward numeric), and the built-in character models cannot take them.
CHAT_TASKS = frozenset({"addition_chat"})

MIX_SEPARATOR = "+"  # data.task=reverse+sort mixes built-in tasks row by row (each row's data_source: its task)


def task_names(task: str) -> list[str]:
    """The built-in tasks of a data.task value: `reverse` -> [reverse], `reverse+sort` -> [reverse, sort]."""
    return task.split(MIX_SEPARATOR)


def draw_examples(
    task: str, rng: random.Random, min_len: int, max_len: int, count: int, exclude: frozenset[str] = frozenset()
) -> list[tuple[str, Example]]:
    """`count` examples of `task` as (task name, example); a mixture takes its tasks in turn (row i: task i mod k),
    so every batch holds each task equally. One task draws exactly as `TASKS.get(task)` called `count` times, save
    that an example whose prompt is in `exclude` (the held-out prompts) is drawn again."""
    names = task_names(task)
    samplers = [TASKS.get(name) for name in names]
    out = []
    for i in range(count):
        name, sampler = names[i % len(names)], samplers[i % len(names)]
        for _ in range(MAX_REDRAWS):
            example = sampler(rng, min_len, max_len)
            if example.prompt not in exclude:
                break
        else:
            raise ConfigError(
                f"built-in task {name!r} with data.min_len={min_len}, data.max_len={max_len} drew only held-out"
                f" prompts in {MAX_REDRAWS} tries: the evaluation set covers (nearly) all of the task's prompts. Fix:"
                " raise data.max_len or lower data.eval_prompts"
            )
        out.append((name, example))
    return out


MAX_REDRAWS = 1000  # draws of one training example before the held-out set is taken to cover the task


# Every character any built-in task can produce; the built-in tokenizer covers exactly these.
TASK_ALPHABET = LETTERS + DIGITS + "+=>"
