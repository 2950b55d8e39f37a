"""The prompt stream over a prompt file: epochs, seeded shuffling, a held-out set, lazy length checks.

`batch(step, g)` is a pure function of (seed, step) for a given file and tokenizer, so a resumed run
draws the same prompts. The stream is the training rows in a seeded order per epoch (a fresh order
each epoch), with over-long prompts skipped (`overlong="filter"`) or refused (`"error"`); step s takes
the valid rows s*g .. s*g+g-1 of that stream. Prompts are tokenized only when the stream reaches them
(and remembered as valid/over-long), so step 0 never waits for a whole file to be tokenized; a
restart at step s re-checks the lengths of the s*g rows before it, not the whole file.

A file with a `teacher_prompt` column (data/files.py TEACHER_COLUMN) gives each row the teacher's own prompt,
encoded as the prompt is (the chat template and its assistant opener, or raw text): the teacher and the student
share a tokenizer and chat format (models/tokenizer_match.py), so the student's tokenizer renders both. A row is
valid only when both prompts fit data.max_prompt_length (an over-long teacher prompt is filtered or refused by
data.overlong like the prompt, never cut) and both end with the same assistant opener.
"""

from __future__ import annotations

import numpy as np

from miniverl.batches import PromptBatch
from miniverl.data.charset import check_encodable
from miniverl.data.files import (
    TEACHER_COLUMN,
    Columns,
    has_teacher_prompts,
    is_verl_table,
    load_prompts,
    teacher_messages,
    verl_row,
)
from miniverl.data.templates import check_same_opener, encode_prompt, generation_opener
from miniverl.errors import ConfigError

UNKNOWN, VALID, OVERLONG = 0, 1, 2  # per-row length status, filled in as the stream reaches a row
UNENCODABLE = 3  # set before training: the row holds characters the tokenizer cannot encode (data/charset.py)
HOLDOUT_STREAM = 1  # seed-sequence tag of the held-out split, apart from every epoch's order (tag 0)


def holdout_split(rows: int, eval_prompts: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(held-out row indices, training row indices in file order) when no data.val_files is given."""
    split = np.random.default_rng([seed, HOLDOUT_STREAM]).permutation(rows)
    return split[:eval_prompts], np.sort(split[eval_prompts:])


class FilePromptSource:
    def __init__(
        self,
        train_files: list[str],
        val_files: list[str],
        columns: Columns,
        tokenizer,
        use_template: bool,
        max_prompt_length: int,
        overlong: str,
        shuffle: bool,
        eval_prompts: int,
        seed: int,
        max_unencodable_rows: int = 0,
    ) -> None:
        self.columns, self.tokenizer, self.use_template = columns, tokenizer, use_template
        self.max_prompt_length, self.overlong, self.shuffle, self.seed = max_prompt_length, overlong, shuffle, seed
        self.train = load_prompts(train_files, columns, "data.train_files")
        if val_files:
            self.val = load_prompts(val_files, columns, "data.val_files")
            if has_teacher_prompts(self.val) != has_teacher_prompts(self.train):
                has, lacks = ("train", "val") if has_teacher_prompts(self.train) else ("val", "train")
                raise ConfigError(
                    f"data.{has}_files rows have a {TEACHER_COLUMN} column and data.{lacks}_files rows do not, so"
                    " training and evaluation would score against different teachers; give both files the column,"
                    " or neither"
                )
            self.train_idx = np.arange(len(self.train))
            self.eval_idx = np.arange(len(self.val))
        else:
            if len(self.train) <= eval_prompts:
                raise ConfigError(
                    f"data.train_files holds {len(self.train)} rows and data.eval_prompts={eval_prompts} of them"
                    " would be held out for evaluation, leaving none to train on; lower data.eval_prompts or pass"
                    " data.val_files"
                )
            self.val = self.train
            self.eval_idx, self.train_idx = holdout_split(len(self.train), eval_prompts, seed)
        self.teacher = has_teacher_prompts(self.train)  # each row's own teacher prompt (privileged context)
        self.opener = generation_opener(tokenizer) if self.teacher and use_template else []
        self.status = {
            id(self.train): np.zeros(len(self.train), np.int8),
            id(self.val): np.zeros(len(self.val), np.int8),
        }
        # Every prompt's characters are checked now, before training (silently mangled prompts are worse
        # than a refusal); rows within data.max_unencodable_rows are skipped like over-long ones.
        self.unencodable_count = 0
        tables = [(self.train, train_files, "data.train_files")]
        if val_files:
            tables.append((self.val, val_files, "data.val_files"))
        for table, files, key in tables:
            prompt = "prompt" if is_verl_table(table) else columns.prompt_key
            for column in (prompt, TEACHER_COLUMN) if self.teacher else (prompt,):
                allowed = max_unencodable_rows - self.unencodable_count
                rows = check_encodable(table, column, tokenizer, list(files), key, allowed)
                status = self.status[id(table)]
                fresh = [r for r in rows if status[r] != UNENCODABLE]  # a row bad in both columns counts once
                status[fresh] = UNENCODABLE
                self.unencodable_count += len(fresh)
        self.valid: list[int] = []  # table rows of the training stream, in stream order
        self.scanned = 0  # stream positions examined so far (epoch * len(train_idx) + offset)
        self.overlong_count = 0  # distinct over-long rows met so far (train and eval)
        self.shortest_overlong = 10**9  # tokens of the shortest over-long prompt met so far (its refusal names it)
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def describe(self) -> str:
        answers = ""
        if is_verl_table(self.train):
            kind = "verl schema"
        elif self.columns.has_answers:
            kind = f"columns {self.columns.prompt_key}/{self.columns.answer_key}"
        else:  # never claim an answer column that is not there, nor an accuracy that cannot be measured
            kind = f"column {self.columns.prompt_key}"
            answers = "; no answers (data.answer_key=''): every ground truth is empty, so task accuracy reads 0"
            answers += " and means nothing"
        template = "chat template" if self.use_template else "raw text"
        if self.teacher:
            template += f"; the teacher's prompt from column {TEACHER_COLUMN}"
        skipped = f", {self.unencodable_count} unencodable rows skipped" if self.unencodable_count else ""
        return (
            f"{len(self.train_idx)} training and {len(self.eval_idx)} evaluation prompts ({kind}, {template}{skipped})"
            f"{answers}"
        )

    def order(self, epoch: int) -> np.ndarray:
        """Training rows in the order of `epoch`: a fresh seeded permutation per epoch (or file order)."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            rows = self.train_idx
            if self.shuffle:
                rows = rows[np.random.default_rng([self.seed, 0, epoch]).permutation(len(rows))]
            self._epoch_order = (epoch, rows)
        return self._epoch_order[1]

    def _encode(self, table, index: int) -> tuple[dict, list[int] | None, list[int] | None]:
        """The verl row, its ids and its teacher prompt's ids (None without the column), or None for both ids when
        the row is over-long and filtered."""
        raw = table[int(index)]
        row = verl_row(raw, self.columns, int(index))
        status = self.status[id(table)]
        if status[index] in (OVERLONG, UNENCODABLE):
            return row, None, None
        ids = encode_prompt(self.tokenizer, row["prompt"], self.use_template)
        teacher = None
        if self.teacher:
            teacher = encode_prompt(self.tokenizer, teacher_messages(raw), self.use_template)
        longest = max(len(ids), len(teacher or ()))
        if longest <= self.max_prompt_length:
            if teacher is not None:  # a template fault, not a length: refused whatever data.overlong says
                fix = (
                    f"make the {TEACHER_COLUMN} end as the prompt does (raw text: the same last text; chat messages:"
                    " ones the template opens the answer after alike), or drop the column"
                )
                check_same_opener(ids, teacher, self.opener, f"{self._named(table)} row {index}", fix)
            status[index] = VALID
            return row, ids, teacher
        if self.overlong == "error":
            what = "prompt" if len(ids) == longest else TEACHER_COLUMN
            raise ConfigError(
                f"{self._named(table)} row {index}: its {what} has {longest} tokens, more than"
                f" data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length, or set"
                " data.overlong=filter to skip such rows"
            )
        status[index] = OVERLONG
        self.overlong_count += 1
        self.shortest_overlong = min(self.shortest_overlong, longest)
        return row, None, None

    def _named(self, table) -> str:
        return "data.val_files" if table is not self.train else "data.train_files"

    def _extend(self, count: int) -> None:
        """Scan the stream until it holds `count` valid rows."""
        n = len(self.train_idx)
        status = self.status[id(self.train)]
        while len(self.valid) < count:
            epoch, offset = divmod(self.scanned, n)
            index = int(self.order(epoch)[offset])
            if status[index] == VALID or (status[index] == UNKNOWN and self._encode(self.train, index)[1] is not None):
                self.valid.append(index)
            self.scanned += 1
            if self.scanned % n == 0 and not (status[self.train_idx] == VALID).any():
                theirs = f" (or its {TEACHER_COLUMN})" if self.teacher else ""
                raise ConfigError(
                    f"every training prompt{theirs} is longer than data.max_prompt_length={self.max_prompt_length}"
                    f" tokens (the shortest, after the chat template, has {self.shortest_overlong}); raise"
                    f" data.max_prompt_length to at least {self.shortest_overlong}"
                )

    def _batch(self, table, indices: list[int], prefix: str) -> PromptBatch:
        rows = [self._encode(table, i) for i in indices]
        return PromptBatch(
            [ids for _, ids, _ in rows],
            [f"{prefix}-{i}" for i in range(len(rows))],
            [r["reward_model"]["ground_truth"] for r, _, _ in rows],
            [r["data_source"] for r, _, _ in rows],
            [r["extra_info"] for r, _, _ in rows],
            [teacher for _, _, teacher in rows] if self.teacher else None,
        )

    def batch(self, step: int, groups: int) -> PromptBatch:
        self._extend((step + 1) * groups)
        return self._batch(self.train, self.valid[step * groups : (step + 1) * groups], f"s{step}")

    def eval_batch(self, count: int) -> PromptBatch:
        """The first `count` valid held-out prompts (all of them when fewer)."""
        keep: list[int] = []
        for i in self.eval_idx:  # lazily: a large val file is read only as far as `count` prompts
            if len(keep) == count:
                break
            if self._encode(self.val, int(i))[1] is not None:
                keep.append(int(i))
        if not keep:
            raise ConfigError(
                f"no evaluation prompt fits data.max_prompt_length={self.max_prompt_length} (the shortest over it has"
                f" {self.shortest_overlong} tokens after the chat template); raise it to at least"
                f" {self.shortest_overlong}"
            )
        return self._batch(self.val, keep, "eval")
