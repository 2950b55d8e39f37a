"""One builder from DataConfig to the run's prompt source (a built-in task or prompt files)."""

from __future__ import annotations

from typing import Protocol

from miniverl.batches import PromptBatch
from miniverl.data.files import Columns
from miniverl.data.prompts import PromptSource
from miniverl.data.stream import FilePromptSource


class PromptStream(Protocol):
    """`batch(step, g)` depends only on (seed, step): a resumed run sees the same prompts."""

    overlong_count: int

    def batch(self, step: int, groups: int) -> PromptBatch: ...

    def eval_batch(self, count: int) -> PromptBatch: ...

    def describe(self) -> str: ...


def build_prompt_source(d, tokenizer, total_steps: int, log=print) -> PromptStream:
    """The prompt source of DataConfig `d`, checked as far as is cheap before training starts.

    Built-in tasks draw and length-check every step's prompts now (microseconds each). Prompt files
    are checked lazily as the stream reaches each row: here only the held-out set and step 0.
    """
    if not d.train_files:
        source = PromptSource(
            d.task,
            d.min_len,
            d.max_len,
            tokenizer,
            d.max_prompt_length,
            d.seed,
            d.eval_prompts,
            d.teacher_demonstrations,
        )
        for step in range(total_steps):
            source.batch(step, d.prompts_per_step)
    else:
        source = FilePromptSource(
            list(d.train_files),
            list(d.val_files),
            Columns(d.prompt_key, d.answer_key, d.default_data_source),
            tokenizer,
            d.chat_template,
            d.max_prompt_length,
            d.overlong,
            d.shuffle,
            d.eval_prompts,
            d.seed,
            d.max_unencodable_rows,
        )
        source.batch(0, d.prompts_per_step)
    source.eval_batch(d.eval_prompts)  # counts over-long held-out prompts; an all-over-long set fails here
    log(
        f"[miniverl] prompts: {source.describe()}; {source.overlong_count} over data.max_prompt_length="
        f"{d.max_prompt_length} filtered so far (the rest are checked as the stream reaches them:"
        " metric data/overlong_filtered)"
    )
    return source
