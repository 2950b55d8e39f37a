"""A run as the bridge sees it: the typed config plus what the refusals and translation need beyond it."""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config import MiniVerlConfig


@dataclass(frozen=True)
class RunSpec:
    """A composed run as the bridge sees it: the typed config plus facts read from its models and data."""

    cfg: MiniVerlConfig
    verl_version: str
    student_quantization: str | None = None  # model.student.quantization, when the config carries it
    student_vocab_size: int | None = None  # from the student's config.json when it is a local directory
    # What the student's tokenizer adds to a plain prompt: "none", "bos", another description, None = unknown
    prompt_special_tokens: str | None = None
    student_chat_template: bool | None = None  # whether the student's tokenizer has one; None = unknown
    data_sources: tuple[str, ...] = ()  # every data_source of the exported rows (they pick the reward)
    # {"train": rows, "test": rows} in verl's schema (miniverl.bridge.data), read once for checks and export
    rows: dict = field(default_factory=dict, repr=False, compare=False)
