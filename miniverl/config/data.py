"""The data section: the prompts a run trains and evaluates on, and the checks of its values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miniverl.config.base import require

OVERLONG_POLICIES = ("filter", "error")  # data.overlong


@dataclass
class DataConfig:
    task: str = "reverse"  # a name in miniverl.data.tasks.TASKS, or several joined by + (mixed row by row)
    min_len: int = 3  # problem size bounds (characters to reverse, digits to add)
    max_len: int = 8
    prompts_per_step: int = 32  # G: prompt groups per step (each sampled rollout.n times)
    eval_prompts: int = 64  # fixed held-out prompts for the start/periodic/final evaluation (built-ins: never trained)
    max_prompt_length: int = 32  # tokens, after the chat template; a longer prompt is never cut (data.overlong)
    # Privileged context for the teacher (chat tasks): each row's teacher prompt holds this many solved examples of
    # the task as earlier chat turns before the student's question; the student never sees them (context
    # distillation). Drawn per row from the training distribution, never a held-out problem or the row's own.
    # Teacher prompts count against data.max_prompt_length too. 0 = the teacher scores the student's own prompt.
    # Prompt files give the teacher context per row instead, by a `teacher_prompt` column (no key: data/files.py).
    teacher_demonstrations: int = 0
    seed: int = 0
    # Prompt files (jsonl or verl-schema parquet). Empty: prompts come from the built-in data.task.
    # A path or a list of paths (verl's docs write data.train_files=train.parquet); typed Any because
    # OmegaConf has no str-or-list type, normalized to a list in __post_init__ and checked in validate.
    train_files: Any = field(default_factory=list)
    val_files: Any = field(default_factory=list)  # empty: hold out data.eval_prompts training rows
    # plain jsonl: the column with the prompt (text, or a list of chat messages). A `teacher_prompt` column, of the
    # same forms, in every row (verl or plain) is the teacher's own prompt of the row: privileged context.
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # plain jsonl: the column with the ground truth; '' = the prompts have no answers
    default_data_source: str = "jsonl"  # plain jsonl rows without a data_source column (picks the reward)
    chat_template: bool = True  # wrap prompts with the tokenizer's chat template; false = raw text prompts
    overlong: str = "filter"  # a prompt over max_prompt_length: filter (skip and count) | error (stop)
    shuffle: bool = True  # seeded reshuffle every epoch; false = file order
    # Prompt rows allowed to hold characters the student's tokenizer cannot encode (dropped, or turned into
    # its unknown token); they are skipped and counted. More such rows than this refuses the run, naming them.
    max_unencodable_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("train_files", "val_files"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value] if value else [])
            elif isinstance(value, list | tuple):
                setattr(self, name, list(value))

    def check(self) -> None:
        """data's own values. Whether the prompt files exist is check_files' (it reads the disk)."""
        from miniverl.data.files import TEACHER_COLUMN
        from miniverl.data.tasks import CHAT_TASKS, TASKS, task_names

        require(self.prompts_per_step > 0, f"data.prompts_per_step={self.prompts_per_step}: must be >= 1")
        require(self.eval_prompts > 0, f"data.eval_prompts={self.eval_prompts}: must be >= 1")
        require(
            0 < self.min_len <= self.max_len,
            f"data.min_len/max_len={self.min_len}/{self.max_len}: need 0 < min_len <= max_len",
        )
        require(self.max_prompt_length > 0, f"data.max_prompt_length={self.max_prompt_length}: must be >= 1")
        require(
            self.teacher_demonstrations >= 0,
            f"data.teacher_demonstrations={self.teacher_demonstrations}: use 0 (none) or a count of solved examples",
        )
        require(
            self.overlong in OVERLONG_POLICIES,
            f"data.overlong={self.overlong!r}: use filter (skip and count over-long prompts) or error (stop on the"
            " first)",
        )
        require(
            not self.val_files or self.train_files,
            "data.val_files is set but data.train_files is empty; give the training file too (data.train_files=[...])",
        )
        for key, files in (("data.train_files", self.train_files), ("data.val_files", self.val_files)):
            require(
                isinstance(files, list) and all(isinstance(f, str) and f for f in files),
                f"{key}={files!r}: give a file path or a list of them ({key}=train.jsonl or {key}=[a.jsonl,b.jsonl])",
            )
        require(
            self.max_unencodable_rows >= 0,
            f"data.max_unencodable_rows={self.max_unencodable_rows}: use 0 (refuse any) or a row count to skip",
        )
        for task in task_names(self.task):
            TASKS.require(task)
        chat = [t for t in task_names(self.task) if t in CHAT_TASKS]
        require(
            not chat or len(chat) == len(task_names(self.task)),
            f"data.task={self.task} mixes chat tasks ({', '.join(chat)}) with character tasks, which no one model"
            " takes; train them in separate runs",
        )
        teacher_column = f" and give each row its teacher context in a {TEACHER_COLUMN} column (text or chat messages)"
        require(
            self.teacher_demonstrations == 0 or (chat and not self.train_files),
            f"data.teacher_demonstrations={self.teacher_demonstrations} draws solved examples from a built-in chat task"
            f" ({', '.join(sorted(CHAT_TASKS))}), but data.task={self.task}"
            f"{' and data.train_files is set' if self.train_files else ''}; set data.task=addition_chat (no prompt"
            f" files), or data.teacher_demonstrations=0{teacher_column if self.train_files else ''}",
        )
        for key in ("prompt_key", "answer_key"):
            require(
                getattr(self, key) != TEACHER_COLUMN,
                f"data.{key}={TEACHER_COLUMN}: that column is the teacher's own prompt of each row (privileged"
                f" context), never the student's {key.removesuffix('_key')}; rename the column in the file",
            )
