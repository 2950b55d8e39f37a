"""A run as the bridge sees it: the typed config plus what the refusals and translation need beyond it."""

from __future__ import annotations

from dataclasses import dataclass

from miniverl.config import MiniVerlConfig


@dataclass(frozen=True)
class RunSpec:
    """A composed run as the bridge sees it: the typed config plus keys the schema may not have yet."""

    cfg: MiniVerlConfig
    verl_version: str
    student_quantization: str | None = None  # model.student.quantization, when the config carries it
    reward: str | None = None  # the reward's name; None = the task's own (TASK_REWARDS)
    student_vocab_size: int | None = None  # from the student's config.json when it is a local directory
    # What the student's tokenizer adds to a plain prompt: "none", "bos", another description, None = unknown
    prompt_special_tokens: str | None = None
