"""Prompt files read with Hugging Face `datasets`: verl-schema parquet/jsonl, or plain jsonl by column mapping.

A verl row (the schema verl 0.9's data preprocessors write) is
`{data_source, prompt: [{role, content}, ...], ability, reward_model: {style, ground_truth}, extra_info}`.
A plain row has a prompt column (`data.prompt_key`, text or chat messages) and an answer column
(`data.answer_key`; `''` for prompts without answers); `verl_row` turns either into the verl form, which is
what the rest of miniVERL (and the verl bridge, through `verl_rows`) reads. `datasets` memory-maps the file
as Arrow, so reading a row costs the same in a file of 10 rows or 10 million.

`load_prompts` refuses, before anything starts, a file any row of which would train as something other
than what the file says: a JSON line that does not parse or repeats a key (datasets keeps one of the two, or
turns a list of messages into one message), a prompt that is null, empty, or neither text nor chat messages,
an answer that is missing, a value datasets would change ("1.50" read as 1.5). Each error names the file, the
line (JSON lines) or row, and the fix.

A row may also give the teacher a prompt of its own (privileged context the student never sees: a hint, the
worked solution, demonstrations): a `teacher_prompt` column (TEACHER_COLUMN), text or chat messages like the
prompt, in every row of every file or in none. The teacher scores the student's response after it
(data/stream.py builds its ids, workers/scorer.py scores after them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from miniverl.errors import ConfigError

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # file suffix -> datasets builder
VERL_COLUMNS = ("data_source", "prompt", "reward_model")  # the columns that mark a verl-schema file
VERL_ANSWER = "reward_model.ground_truth"
NO_ANSWERS = ""  # data.answer_key of plain prompts without answers (distillation needs none)
JSON_SPACE = b" \t\r\n"  # the whitespace JSON allows around a value (bytes.strip() would also take \x0b, \x0c)
BOM = b"\xef\xbb\xbf"  # datasets (pyarrow) skips a UTF-8 byte-order mark at the start of a file; json.loads does not
SCAN_BATCH_ROWS = 4096  # rows read from the Arrow table at a time
LOSSY_FEATURES = ("Json", "float")  # datasets features a JSON value may have been changed into (see check_rows)
PROMPT_FIX = "give the row a prompt (text, or chat messages [{role, content}, ...]) or remove it"
ANSWER_FIX = "give the row an answer or remove it (it would be scored against an empty answer)"
# The teacher's own prompt of a row, by name (no config key): a file without the column scores the student's prompt.
TEACHER_COLUMN = "teacher_prompt"
TEACHER_FIX = (
    "give every row a teacher_prompt (text, or chat messages [{role, content}, ...]) or drop the column from every"
    " row (then the teacher scores the student's prompt)"
)


@dataclass(frozen=True)
class Columns:
    """How plain rows map to verl fields (DataConfig.prompt_key/answer_key/default_data_source)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"  # NO_ANSWERS: the rows have none, and every ground truth is empty
    default_data_source: str = "jsonl"

    @property
    def has_answers(self) -> bool:
        return self.answer_key != NO_ANSWERS


@dataclass(frozen=True)
class FileForm:
    """One prompt file, and whether its rows are its non-blank lines (JSON lines: a row is named by its
    line) or not (parquet, one JSON document: a row is named by its number from 0)."""

    path: Path
    json_lines: bool


def check_paths(paths: list[str], field: str) -> list[Path]:
    """`paths` as files of one format; a missing path or a directory is refused with the fix."""
    files = [Path(p).expanduser() for p in paths]
    for f in files:
        if f.is_dir():
            inside = sorted(p.name for p in f.iterdir() if p.suffix in LOADERS)
            holds = f"it holds {', '.join(inside[:4])}" if inside else f"it holds no {'/'.join(LOADERS)} files"
            example = next((n for n in inside if "train" in n), inside[0] if inside else "train.parquet")
            raise ConfigError(
                f"{field}: {f} is a directory, not a prompt file ({holds}); pass the files themselves,"
                f" e.g. {field}=[{f / example}]"
            )
        if not f.is_file():
            raise ConfigError(f"{field}: {f} does not exist; pass existing .jsonl or .parquet files")
    kinds = {LOADERS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(
            f"{field}={paths}: use files of one format, ending in {', '.join(LOADERS)}"
            f" (found {sorted({f.suffix for f in files})})"
        )
    return files


def load_prompts(paths: list[str], columns: Columns, field: str):
    """The rows of all `paths` (one format) as a `datasets.Dataset`, each holding a prompt and, unless
    `columns` says there are none, an answer; errors name `field`, the file, the line or row, and the fix.

    Cost, before anything starts: JSON text is parsed once more than datasets parses it (to find repeated
    keys), and the prompt and answer columns are read once; 200k verl rows of 1 KB (192 MB) took 4.4 s and
    1.8 s on the CPU of the dev machine, GSM8K's 7.5k rows a fortieth of that."""
    import datasets

    files = check_paths(paths, field)
    forms = [check_file_text(f, field) for f in files]
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(LOADERS[files[0].suffix], data_files=[str(f) for f in files], split="train")
    except Exception as e:  # name the line where we can (a column of mixed JSON types), else the library's reason
        # a teacher_prompt column in any file is owed by every row (a file without it makes datasets fail here)
        teacher = any(TEACHER_COLUMN in row for f in forms if f.json_lines for _, row in json_lines(f.path, field))
        for form in forms:
            _refuse_first_bad_line(form, columns, field, teacher)
            _refuse_mixed_column_and_blank_lines(form, field)
        raise ConfigError(f"{field}={paths}: cannot read it ({e.__class__.__name__}: {e})") from e
    if len(table) == 0:
        raise ConfigError(f"{field}={paths}: the files hold no rows")
    check_columns(table, columns, field, files)
    check_rows(table, columns, field, forms)
    return table


def check_file_text(file: Path, field: str) -> FileForm:
    """An empty file, or a JSON file that is not UTF-8 or not JSON, named with its line, before `datasets`
    reads it (it fails with a bare StopIteration or a message without the file, accepts latin-1 bytes and
    raises UnicodeDecodeError mid-run, and keeps one of two equal keys)."""
    if file.stat().st_size == 0:
        raise ConfigError(f"{field}: {file} is empty (0 bytes); pass a file with prompt rows")
    if LOADERS.get(file.suffix) != "json":
        return FileForm(file, json_lines=False)
    if _is_document(file):
        _check_document(file, field)
        return FileForm(file, json_lines=False)
    rows = 0
    for number, row in json_lines(file, field):
        if not isinstance(row, dict):
            raise ConfigError(
                f"{field}: {file} line {number} holds {_kind(row)}, not a JSON object; write one JSON object per line"
            )
        rows += 1
    if not rows:
        raise ConfigError(f"{field}: {file} holds only blank lines; pass a file with one JSON object per line")
    return FileForm(file, json_lines=True)


def json_lines(file: Path, field: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSON-lines file; a line that is not UTF-8 text or not
    one JSON value, or an object that repeats a key, raises ConfigError naming the line and the reason."""
    with file.open("rb") as f:
        for number, line in enumerate(f, 1):
            text = _utf8(line.removeprefix(BOM) if number == 1 else line, number, file, field)
            if not text.strip(JSON_SPACE.decode()):
                continue
            try:
                value = _parse(text)
            except ValueError as e:
                raise ConfigError(
                    f"{field}: {file} line {number} is not valid JSON ({_reason(e)}); write one JSON object per line"
                ) from e
            yield number, value


def _utf8(line: bytes, number: int, file: Path, field: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{field}: {file} line {number} is not UTF-8 text (byte 0x{line[e.start]:02x} at column"
            f" {e.start + 1}: {e.reason}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 {file.name})"
        ) from e


class DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKey(f"key {key!r} appears twice in one object")
    return out


def _parse(text: str | bytes) -> Any:
    """A JSON value; an object that repeats a key raises DuplicateKey (json.loads would keep the last)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _reason(e: ValueError) -> str:
    return f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)


def _is_document(file: Path) -> bool:
    """Whether a .json/.jsonl file is one JSON value over many lines, as datasets also reads: an array of
    rows, or one pretty-printed object (its first line alone does not parse, the whole file does)."""
    with file.open("rb") as f:
        first = next((line.strip(JSON_SPACE) for line in f if line.strip(JSON_SPACE) not in (b"", BOM)), b"")
    first = first.removeprefix(BOM)
    if first.startswith(b"["):
        return True
    try:
        json.loads(first)
        return False
    except ValueError:  # a broken first row, or the first line of a pretty-printed object
        try:
            json.loads(file.read_bytes().removeprefix(BOM))
            return True
        except ValueError:
            return False


def _check_document(file: Path, field: str) -> None:
    with file.open("rb") as f:
        for number, line in enumerate(f, 1):
            _utf8(line, number, file, field)
    try:
        _parse(file.read_bytes().removeprefix(BOM))
    except ValueError as e:
        reason = f"line {e.lineno}, {_reason(e)}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ConfigError(
            f"{field}: {file} is not valid JSON ({reason}); fix it, or write one JSON object per line"
        ) from e


def is_verl_table(table) -> bool:
    return all(c in table.column_names for c in VERL_COLUMNS)


def check_columns(table, columns: Columns, field: str, files: list[Path]) -> None:
    """A plain table needs the prompt column, and the answer column unless there are no answers; say which
    columns the files have when one is missing."""
    if is_verl_table(table):
        return
    named = f"{field}: {', '.join(map(str, files))} {'has' if len(files) == 1 else 'have'}"
    have = ", ".join(table.column_names)
    if columns.prompt_key not in table.column_names:
        raise ConfigError(
            f"{named} no column {columns.prompt_key!r} (columns: {have}); set data.prompt_key=<column>"
            f" (and data.answer_key=<column>), or write verl rows with {', '.join(VERL_COLUMNS)}"
        )
    if columns.has_answers and columns.answer_key not in table.column_names:
        raise ConfigError(
            f"{named} no answer column {columns.answer_key!r} (columns: {have}); set data.answer_key=<column>,"
            " or data.answer_key='' if the prompts have no answers (distillation needs none; task accuracy then"
            " means nothing)"
        )


def prompt_problem(value: Any) -> str | None:
    """Why a prompt cell cannot train as written (None: it can): text, or a list of {role, content} messages."""
    if value is None:
        return "is null"
    if isinstance(value, str):
        return None if value.strip() else f"is {'an empty string' if not value else 'only whitespace'}"
    if not isinstance(value, list):
        return f"is {_kind(value)} ({_short(value)}), not text"
    if not value:
        return "is an empty list of messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is {_short(m)}, not a {{role, content}} message with text content"
    if not any(m["content"].strip() for m in value):
        return "holds only empty messages"
    return None


def teacher_prompt_problem(value: Any) -> str | None:
    """Why a teacher prompt cell cannot be scored after (None: it can): as a prompt; datasets reads a row whose line
    lacks the column as null, so null is named as both."""
    return "is missing or null" if value is None else prompt_problem(value)


def answer_problem(value: Any) -> str | None:
    """Why an answer cell cannot be scored as written (None: it can): text or a finite number."""
    if value is None:
        return "is null"
    if isinstance(value, str):
        return None if value.strip() else "is empty"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"is {_kind(value)} ({_short(value)}), not text or a number"
    return None if math.isfinite(value) else f"is {value}"


@dataclass(frozen=True)
class Cell:
    """One checked field of a row: its name in errors, how to read it from a row, what is wrong with it."""

    name: str
    column: str
    read: Callable[[Any], Any]  # the column's value -> the field's
    problem: Callable[[Any], str | None]
    fix: str
    fix_every_row: str = ""  # the fix when no row holds it (a column of nulls)


def cells_of(verl: bool, columns: Columns, teacher: bool = False) -> list[Cell]:
    """The prompt and (if the rows have them) the answer of a verl or a plain row, and its teacher prompt when the
    file has that column (`teacher`): a row without one (null, or the key missing from its line) is refused."""
    teacher_cells = (
        [Cell(TEACHER_COLUMN, TEACHER_COLUMN, _same, teacher_prompt_problem, TEACHER_FIX)] if teacher else []
    )
    if verl:
        every = f"fill {VERL_ANSWER} in every row, or write plain rows with data.answer_key='' if there are no answers"
        return [
            Cell("prompt", "prompt", _same, prompt_problem, PROMPT_FIX),
            Cell(VERL_ANSWER, "reward_model", _ground_truth, answer_problem, ANSWER_FIX, every),
            *teacher_cells,
        ]
    cells = [Cell(columns.prompt_key, columns.prompt_key, _same, prompt_problem, PROMPT_FIX)]
    if columns.has_answers:
        every = "set data.answer_key to the column that holds the answers, or data.answer_key='' if there are none"
        cells.append(Cell(columns.answer_key, columns.answer_key, _same, answer_problem, ANSWER_FIX, every))
    return cells + teacher_cells


def has_teacher_prompts(table) -> bool:
    """Whether the rows give the teacher prompts of their own (the TEACHER_COLUMN column)."""
    return TEACHER_COLUMN in table.column_names


def _same(value: Any) -> Any:
    return value


def _ground_truth(reward_model: Any) -> Any:
    return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None


def check_rows(table, columns: Columns, field: str, forms: list[FileForm]) -> None:
    """Every prompt is text or chat messages and every answer is there, as the file wrote them: one pass
    over those columns; the first bad cell is named with its file and line, and the others counted."""
    cells = cells_of(is_verl_table(table), columns, has_teacher_prompts(table))
    _refuse_values_datasets_changed(table, cells, forms, field)
    first: dict[str, tuple[int, str]] = {}
    count = dict.fromkeys((c.name for c in cells), 0)
    for row, values in enumerate(_table_rows(table, cells)):
        for c, value in zip(cells, values):
            why = c.problem(value)
            if why is not None:
                count[c.name] += 1
                first.setdefault(c.name, (row, why))
    for c in cells:
        if c.name not in first:
            continue
        at, why = first[c.name]
        if count[c.name] == len(table) and c.fix_every_row:
            files = ", ".join(str(f.path) for f in forms)
            raise ConfigError(f"{field}: {c.name} {why} in every row of {files}; {c.fix_every_row}")
        others = count[c.name] - 1
        more = f" ({others} more {'row' if others == 1 else 'rows'} like it)" if others else ""
        raise ConfigError(f"{field}: {where(forms, at)}: {c.name} {why}; {c.fix}{more}")


def _table_rows(table, cells: list[Cell]) -> Iterator[list[Any]]:
    """Each row's value of every cell, in table order."""
    names = list(dict.fromkeys(c.column for c in cells))
    for batch in table.select_columns(names).iter(batch_size=SCAN_BATCH_ROWS):
        for i in range(len(batch[names[0]])):
            yield [c.read(batch[c.column][i]) for c in cells]


def _trains_as(cell: Cell, value: Any) -> Any:
    """What training uses of a cell: an answer's text; a prompt as it is, or each message's role and text."""
    if cell.problem is answer_problem:
        return value if value is None else str(value)
    if isinstance(value, list):
        return [(m.get("role"), m.get("content")) if isinstance(m, dict) else m for m in value]
    return value


def _refuse_values_datasets_changed(table, cells: list[Cell], forms: list[FileForm], field: str) -> None:
    """datasets reads a JSON column that mixes types as JSON, turning the string "1.50" into 1.5 and "true"
    into True, and a column of integers and non-integers as floats, turning 4 into 4.0. Where a prompt or
    answer column is read so, each JSON line is compared with what the table holds."""
    lossy = {c.name for c in cells if any(t in repr(table.features[c.column]) for t in LOSSY_FEATURES)}
    if not lossy or not any(f.json_lines for f in forms):
        return
    read = _table_rows(table, cells)
    for form in forms:
        if not form.json_lines:  # no line to compare with (a JSON document): its rows are skipped
            for _ in islice(read, _row_count(form)):
                pass
            continue
        for (number, row), values in zip(json_lines(form.path, field), read):
            for c, value in zip(cells, values):
                written = c.read(row.get(c.column))
                if c.name in lossy and _trains_as(c, written) != _trains_as(c, value):
                    raise ConfigError(
                        f"{field}: {form.path} line {number}: {c.name} {_short(written)} would be read as"
                        f" {_short(value)} (datasets reads a column that mixes JSON types as JSON, and one of"
                        f" integers and non-integers as floats); write every {c.name} as text (a JSON string)"
                        + (", or every one as chat messages" if c.problem is not answer_problem else "")
                    )


def _refuse_first_bad_line(form: FileForm, columns: Columns, field: str, teacher: bool) -> None:
    """The first line of a JSON-lines file whose prompt, answer or (`teacher`: the files have the column) teacher
    prompt is bad (datasets may fail on a column of mixed JSON types before check_rows could name it)."""
    if not form.json_lines:
        return
    for number, row in json_lines(form.path, field):
        for c in cells_of(all(k in row for k in VERL_COLUMNS), columns, teacher):
            why = c.problem(c.read(row.get(c.column)))
            if why is not None:
                raise ConfigError(f"{field}: {form.path} line {number}: {c.name} {why}; {c.fix}")


def _refuse_mixed_column_and_blank_lines(form: FileForm, field: str) -> None:
    """datasets 5 fails on a JSON-lines file that has a blank line and a column of mixed JSON types."""
    if not form.json_lines:
        return
    with form.path.open("rb") as f:
        blank = next((n for n, line in enumerate(f, 1) if not line.strip(JSON_SPACE)), None)
    if blank is None:
        return
    first: dict[str, tuple[int, str]] = {}
    for number, row in json_lines(form.path, field):
        for key, value in row.items():
            if value is None:
                continue
            line, kind = first.setdefault(key, (number, _kind(value)))
            if kind != _kind(value):
                raise ConfigError(
                    f"{field}: {form.path} line {blank} is blank and column {key!r} mixes JSON types (line {line}:"
                    f" {kind}, line {number}: {_kind(value)}), which datasets cannot read together; remove the"
                    f" blank lines, or write every {key} as one type"
                )


def where(forms: list[FileForm], row: int) -> str:
    """`file line N` (JSON lines) or `file row N (from 0)` of a row of the concatenated table."""
    for i, form in enumerate(forms):
        rows = None if i == len(forms) - 1 else _row_count(form)
        if rows is None or row < rows:
            if form.json_lines:
                return f"{form.path} line {next(islice(_row_lines(form.path), row, None))}"
            return f"{form.path} row {row} (from 0)"
        row -= rows
    raise IndexError(row)


def _row_lines(path: Path) -> Iterator[int]:
    """The numbers of a JSON-lines file's non-blank lines: its rows, in the order datasets reads them."""
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if (line.removeprefix(BOM) if number == 1 else line).strip(JSON_SPACE):
                yield number


def _row_count(form: FileForm) -> int:
    if form.json_lines:
        return sum(1 for _ in _row_lines(form.path))
    import datasets

    return len(datasets.load_dataset(LOADERS[form.path.suffix], data_files=[str(form.path)], split="train"))


def _kind(value: Any) -> str:
    """The JSON type of a value, with its article (error text)."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), f"a {type(value).__name__}")


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _messages(prompt: str | list) -> list[dict[str, Any]]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def teacher_messages(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """A checked row's teacher prompt (TEACHER_COLUMN) as chat messages: a text is one user message, as a prompt's."""
    return _messages(raw[TEACHER_COLUMN])


def verl_row(raw: dict[str, Any], columns: Columns, index: int) -> dict[str, Any]:
    """One row (checked by `load_prompts`) in verl's schema, whatever its file's form; `extra_info.index`
    defaults to the row number. A text prompt becomes one user message."""
    if all(c in raw for c in VERL_COLUMNS):
        rm = raw["reward_model"]
        extra = dict(raw.get("extra_info") or {})
        extra.setdefault("index", index)
        return {
            "data_source": str(raw["data_source"]),
            "prompt": _messages(raw["prompt"]),
            "ability": raw.get("ability") or "",
            "reward_model": {"style": rm.get("style") or "rule", "ground_truth": str(rm["ground_truth"])},
            "extra_info": extra,
        }
    return {
        "data_source": str(raw.get("data_source") or columns.default_data_source),
        "prompt": _messages(raw[columns.prompt_key]),
        "ability": str(raw.get("ability") or ""),
        "reward_model": {"style": "rule", "ground_truth": str(raw[columns.answer_key]) if columns.has_answers else ""},
        "extra_info": {"index": index},
    }


def verl_rows(paths: list[str], columns: Columns = Columns(), field: str = "data.train_files") -> Iterator[dict]:
    """Every row of `paths` as a verl-schema dict, in file order (for the verl bridge and for tools)."""
    table = load_prompts(paths, columns, field)
    for i, raw in enumerate(table):
        yield verl_row(raw, columns, i)
