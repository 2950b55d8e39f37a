"""Prompt data in verl 0.9's parquet schema, one row per prompt:

    data_source  str                      where the row comes from (the built-in task's name, as miniVERL's
                                          rows carry it, or the file row's own; it picks the reward)
    prompt       [{"role", "content"}]    chat messages; miniVERL's prompts are one user message
    ability      str                      the task family
    reward_model {"style", "ground_truth"}  "rule": the reward compares the response with ground_truth
    extra_info   {"index", "split", "uid"}  row number within its split, and miniVERL's prompt uid

Rows are plain dicts so that any prompt source can feed the exporter: `prompt_rows` is the one seam that
turns a run's data config into rows (built-in tasks, and prompt files through miniverl.data's reader).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path

from miniverl.data.prompts import held_out_examples, held_out_prompts, training_examples
from miniverl.data.stream import VALID as VALID_PROMPT
from miniverl.errors import ConfigError

REWARD_STYLE = "rule"  # verl's name for a programmatic reward that checks ground_truth
ROW_KEYS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


def _schema():
    import pyarrow as pa

    # Fixed types (not inferred per file) so that export -> read -> export gives the same bytes.
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string()), ("uid", pa.string())])),
        ]
    )


def make_row(data_source: str, prompt: str, answer: str, ability: str, index: int, split: str, uid: str) -> dict:
    """One verl row for a single-turn prompt whose reward checks `answer`."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": ability,
        "reward_model": {"style": REWARD_STYLE, "ground_truth": answer},
        "extra_info": {"index": index, "split": split, "uid": uid},
    }


def check_row(row: dict, where: str) -> None:
    """Raise ConfigError naming the first field of `row` that does not fit the schema."""
    if not isinstance(row, dict) or tuple(sorted(row)) != tuple(sorted(ROW_KEYS)):
        got = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(f"{where}: a verl row has exactly the keys {', '.join(ROW_KEYS)}; got {got}")
    msgs = row["prompt"]
    if not msgs or not all(isinstance(m, dict) and set(m) == {"role", "content"} for m in msgs):
        raise ConfigError(f"{where}: prompt must be a non-empty list of {{role, content}} messages; got {msgs!r}")
    rm = row["reward_model"]
    if not isinstance(rm, dict) or not isinstance(rm.get("ground_truth"), str):
        raise ConfigError(f"{where}: reward_model.ground_truth must be a string; got {rm!r}")
    info = row["extra_info"]
    if not isinstance(info, dict) or not isinstance(info.get("index"), int):
        raise ConfigError(f"{where}: extra_info.index must be an integer row number; got {info!r}")


def task_rows(
    task: str, min_len: int, max_len: int, seed: int, steps: int, groups: int, held_out: int = 0
) -> list[dict]:
    """The training prompts a run draws from built-in `task`: `groups` per step for `steps` steps, in order, none
    of them among the first `held_out` evaluation prompts.

    Same seeds and uids as miniverl.data.prompts.PromptSource.batch, so verl sees the run's prompts.
    """
    rows, exclude = [], held_out_prompts(task, min_len, max_len, seed, held_out)
    for step in range(steps):
        for i, (source, ex) in enumerate(training_examples(task, min_len, max_len, seed, step, groups, exclude)):
            rows.append(make_row(source, ex.prompt, ex.answer, source, len(rows), "train", f"s{step}-{i}"))
    return rows


def task_eval_rows(task: str, min_len: int, max_len: int, seed: int, count: int) -> list[dict]:
    """The held-out evaluation prompts (PromptSource.eval_batch), as verl's validation split."""
    examples = held_out_examples(task, min_len, max_len, seed, count)
    return [make_row(s, ex.prompt, ex.answer, s, i, "test", f"eval-{i}") for i, (s, ex) in enumerate(examples)]


def prompt_rows(cfg, tokenizer=None) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows} for a run's data config: the prompts it trains and evaluates on.

    The one place a prompt source becomes verl rows. Prompt files with the student's `tokenizer`: the
    run's own stream (run_file_rows); without one, the files' rows (file_rows).
    """
    d = cfg.data
    if d.train_files:
        return file_rows(d) if tokenizer is None else run_file_rows(d, tokenizer, cfg.trainer.total_steps)
    return {
        "train": task_rows(
            d.task, d.min_len, d.max_len, d.seed, cfg.trainer.total_steps, d.prompts_per_step, d.eval_prompts
        ),
        "test": task_eval_rows(d.task, d.min_len, d.max_len, d.seed, d.eval_prompts),
    }


def file_rows(d) -> dict[str, list[dict]]:
    """A run's prompt files (data.train_files / val_files, read as miniVERL reads them) as verl rows, in file
    order: the held-out split is the one the run evaluates on when no val_files are given."""
    from miniverl.data.files import Columns, has_teacher_prompts, load_prompts, verl_row
    from miniverl.data.stream import holdout_split

    columns = Columns(d.prompt_key, d.answer_key, d.default_data_source)

    def rows(paths: list[str], field: str) -> list[dict]:
        table = load_prompts(paths, columns, field)
        _refuse_teacher_prompts(has_teacher_prompts(table), field)
        return [verl_row(raw, columns, i) for i, raw in enumerate(table)]

    train = rows(d.train_files, "data.train_files")
    if d.val_files:
        test = rows(d.val_files, "data.val_files")
    else:
        held, kept = holdout_split(len(train), d.eval_prompts, d.seed)
        train, test = [train[i] for i in kept], [train[i] for i in held]
    return {
        "train": [_file_row(r, i, "train", f"train-{r['extra_info']['index']}") for i, r in enumerate(train)],
        "test": [_file_row(r, i, "test", f"test-{r['extra_info']['index']}") for i, r in enumerate(test)],
    }


def run_file_rows(d, tokenizer, total_steps: int) -> dict[str, list[dict]]:
    """The prompts a file-based run draws, as miniVERL's FilePromptSource draws them: `total_steps x
    prompts_per_step` training rows in step order (its epochs, seeded shuffle and over-long filter), and
    the first data.eval_prompts held-out rows that fit. uids are the run's (s<step>-<i>, eval-<i>)."""
    from miniverl.data.build import build_prompt_source
    from miniverl.data.files import verl_row

    g = d.prompts_per_step
    source = build_prompt_source(d, tokenizer, total_steps, log=lambda _: None)
    _refuse_teacher_prompts(source.teacher, "data.train_files")
    source.batch(total_steps - 1, g)  # scans the stream up to the last step
    train = [
        _file_row(verl_row(source.train[i], source.columns, i), n, "train", f"s{n // g}-{n % g}")
        for n, i in enumerate(source.valid[: total_steps * g])
    ]
    status = source.status[id(source.val)]
    held = [int(i) for i in source.eval_idx if status[i] == VALID_PROMPT][: d.eval_prompts]
    test = [_file_row(verl_row(source.val[i], source.columns, i), n, "test", f"eval-{n}") for n, i in enumerate(held)]
    return {"train": train, "test": test}


def _refuse_teacher_prompts(present: bool, field: str) -> None:
    """verl 0.9.1's teacher scores the student's prompt: a file's per-row teacher prompts would be dropped unsaid."""
    from miniverl.data.files import TEACHER_COLUMN

    if present:
        raise ConfigError(
            f"{field}: the rows have a {TEACHER_COLUMN} column (the teacher's own prompt), and verl 0.9.1's teacher"
            f" scores the student's prompt, so the export would drop that context; export a copy of the files"
            f" without the {TEACHER_COLUMN} column"
        )


def _file_row(r: dict, index: int, split: str, uid: str) -> dict:
    return {
        "data_source": r["data_source"],
        "prompt": [{"role": m["role"], "content": m["content"]} for m in r["prompt"]],
        "ability": r["ability"],
        "reward_model": {"style": REWARD_STYLE, "ground_truth": r["reward_model"]["ground_truth"]},
        "extra_info": {"index": index, "split": split, "uid": uid},
    }


def jsonl_rows(
    path: str | Path, prompt_key: str, answer_key: str, split: str = "train", ability: str | None = None
) -> list[dict]:
    """verl rows from a user's jsonl file with one prompt and one answer column (read with HF datasets).

    data_source is the file's stem; ability defaults to it too.
    """
    from datasets import load_dataset

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such jsonl file; pass the path of a file with one JSON object per line")
    # A throwaway cache: reading a user's file leaves no Arrow copy of it under ~/.cache, and an edited
    # file is never answered from a stale one.
    with tempfile.TemporaryDirectory() as cache:
        table = load_dataset("json", data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True)
    for key, flag in ((prompt_key, "--prompt-key"), (answer_key, "--answer-key")):
        if key not in table.column_names:
            raise ConfigError(
                f"{path}: no column {key!r}; it has {', '.join(table.column_names)}. Name the column with {flag}"
            )
    source = path.stem
    rows = []
    for i, rec in enumerate(table):
        prompt, answer = rec[prompt_key], rec[answer_key]
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{path}: line {i + 1}: {prompt_key!r} must be a non-empty string; got {prompt!r}")
        rows.append(make_row(source, prompt, str(answer), ability or source, i, split, f"{source}-{i}"))
    return rows


def write_parquet(rows: Iterable[dict], path: str | Path) -> int:
    """Write verl rows to `path` (checked row by row first); returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(rows)
    if not rows:
        raise ConfigError(f"{path}: no rows to write; the prompt source produced none")
    for i, row in enumerate(rows):
        check_row(row, f"{path} row {i}")
    pq.write_table(pa.Table.from_pylist(rows, schema=_schema()), str(path))
    return len(rows)


def read_parquet(path: str | Path) -> list[dict]:
    """verl rows from a parquet file written in verl's schema (by this bridge or by verl's own scripts)."""
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    missing = [k for k in ROW_KEYS if k not in table.column_names]
    if missing:
        raise ConfigError(f"{path}: not verl prompt data, missing columns {', '.join(missing)}")
    rows = table.select(list(ROW_KEYS)).to_pylist()
    for i, row in enumerate(rows):
        check_row(row, f"{path} row {i}")
    return rows
