"""Prompt files read with Hugging Face `datasets`: verl-schema parquet/jsonl, or plain jsonl by column mapping.

A verl row (the schema verl 0.9's data preprocessors write) is
`{data_source, prompt: [{role, content}, ...], ability, reward_model: {style, ground_truth}, extra_info}`.
A plain row has a prompt column (`data.prompt_key`, text or chat messages) and an answer column
(`data.answer_key`); `verl_row` turns either into the verl form, which is what the rest of miniVERL
(and the verl bridge, through `verl_rows`) reads. `datasets` memory-maps the file as Arrow, so reading a
row costs the same in a file of 10 rows or 10 million.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miniverl.errors import ConfigError

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # file suffix -> datasets builder
VERL_COLUMNS = ("data_source", "prompt", "reward_model")  # the columns that mark a verl-schema file


@dataclass(frozen=True)
class Columns:
    """How plain rows map to verl fields (DataConfig.prompt_key/answer_key/default_data_source)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    default_data_source: str = "jsonl"


def load_table(paths: list[str], field: str):
    """The rows of all `paths` (one format) as a `datasets.Dataset`; errors name `field` and the fix."""
    import datasets

    files = [Path(p).expanduser() for p in paths]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"{field}: {missing[0]} does not exist; pass existing .jsonl or .parquet files")
    kinds = {LOADERS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(
            f"{field}={paths}: use files of one format, ending in {', '.join(LOADERS)}"
            f" (found {sorted({f.suffix for f in files})})"
        )
    for f in files:
        check_file_text(f, field)
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    except Exception as e:  # the library's reason (bad JSON line, unreadable parquet) is the useful part
        raise ConfigError(f"{field}={paths}: cannot read it ({e.__class__.__name__}: {e})") from e
    if len(table) == 0:
        raise ConfigError(f"{field}={paths}: the files hold no rows")
    return table


def check_file_text(file: Path, field: str) -> None:
    """An empty file, or a JSON file that is not UTF-8, named with its line, before `datasets` reads it
    (it would fail with a bare StopIteration, or accept the bytes and raise UnicodeDecodeError mid-run)."""
    if file.stat().st_size == 0:
        raise ConfigError(f"{field}: {file} is empty (0 bytes); pass a file with prompt rows")
    if LOADERS.get(file.suffix) != "json":
        return
    blank = True
    with file.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{field}: {file} line {number} is not UTF-8 text (byte 0x{line[e.start]:02x} at column"
                    f" {e.start + 1}: {e.reason}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 {file.name})"
                ) from e
            blank = blank and not text.strip()
    if blank:
        raise ConfigError(f"{field}: {file} holds only blank lines; pass a file with one JSON object per line")


def is_verl_table(table) -> bool:
    return all(c in table.column_names for c in VERL_COLUMNS)


def check_columns(table, columns: Columns, field: str) -> None:
    """A plain table needs the prompt column; say which columns exist when it is missing."""
    if is_verl_table(table) or columns.prompt_key in table.column_names:
        return
    raise ConfigError(
        f"{field}: no column {columns.prompt_key!r} (columns: {', '.join(table.column_names)}); set"
        f" data.prompt_key=<column> (and data.answer_key=<column>), or write verl rows with"
        f" {', '.join(VERL_COLUMNS)}"
    )


def verl_row(raw: dict[str, Any], columns: Columns, index: int) -> dict[str, Any]:
    """One row in verl's schema, whatever its file's form; `extra_info.index` defaults to the row number."""
    if all(c in raw for c in VERL_COLUMNS):
        rm = raw.get("reward_model") or {}
        extra = dict(raw.get("extra_info") or {})
        extra.setdefault("index", index)
        return {
            "data_source": str(raw["data_source"]),
            "prompt": raw["prompt"],
            "ability": raw.get("ability") or "",
            "reward_model": {"style": rm.get("style") or "rule", "ground_truth": _text(rm.get("ground_truth"))},
            "extra_info": extra,
        }
    prompt = raw[columns.prompt_key]
    return {
        "data_source": str(raw.get("data_source") or columns.default_data_source),
        "prompt": prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}],
        "ability": str(raw.get("ability") or ""),
        "reward_model": {"style": "rule", "ground_truth": _text(raw.get(columns.answer_key))},
        "extra_info": {"index": index},
    }


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def verl_rows(paths: list[str], columns: Columns = Columns(), field: str = "data.train_files") -> Iterator[dict]:
    """Every row of `paths` as a verl-schema dict, in file order (for the verl bridge and for tools)."""
    table = load_table(paths, field)
    check_columns(table, columns, field)
    for i, raw in enumerate(table):
        yield verl_row(raw, columns, i)
