"""Built-in synthetic tasks with exact-match answers. Each is a name in TASKS and a `sample` function."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from miniverl.registry import Registry

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


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


TASKS = Registry("task", "data.task")
TASKS.register("reverse", reverse_task)
TASKS.register("addition", addition_task)

# Every character any built-in task can produce; the built-in tokenizer covers exactly these.
TASK_ALPHABET = LETTERS + DIGITS + "+=>"
