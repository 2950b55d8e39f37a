"""Every prompt character must survive the student's tokenizer, or the prompt changes silently.

A tokenizer drops a character it does not know, or encodes it as its unknown token (which decoding
then drops): the built-in character tokenizer knows only `a-z 0-9 + = >`, so `café>` trained as `caf>`.
Before training, every distinct character of every prompt file is encoded and decoded once; rows that
hold a character that does not come back are refused (naming file, row and characters) or, up to
`data.max_unencodable_rows`, skipped and counted. One pass over the prompt column, no tokenization of
whole prompts (the stream still tokenizes lazily).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from miniverl.errors import ConfigError

SCAN_BATCH_ROWS = 4096  # rows read from the Arrow table at a time
SHOWN_ROWS = 3  # rows quoted in a refusal; the rest are counted
CONTEXT = "a"  # a character every tokenizer here knows: a lone space may only round-trip between others
SMALL_VOCAB = 512  # a vocabulary this small is listed in the refusal (the built-in one has 43 tokens)


def _round_trips(tokenizer, text: str) -> bool:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id
    if not ids or (unk is not None and unk in ids):
        return False
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text


def unencodable_chars(tokenizer, chars: Iterable[str]) -> set[str]:
    """The characters the tokenizer drops or maps to its unknown token (each tried alone, then between
    two copies of CONTEXT, for tokenizers that only keep whitespace inside text)."""
    context_ok = _round_trips(tokenizer, CONTEXT)
    return {
        c
        for c in chars
        if not _round_trips(tokenizer, c) and not (context_ok and _round_trips(tokenizer, CONTEXT + c + CONTEXT))
    }


def prompt_texts(prompt) -> list[str]:
    """The texts a prompt cell holds: a string, or the contents of a list of chat messages."""
    if isinstance(prompt, list):
        return [str(m.get("content") or "") if isinstance(m, dict) else str(m) for m in prompt]
    return ["" if prompt is None else str(prompt)]


def _prompt_cells(table, column: str) -> Iterator[list]:
    for batch in table.select_columns([column]).iter(batch_size=SCAN_BATCH_ROWS):
        yield batch[column]


def table_chars(table, column: str) -> set[str]:
    chars: set[str] = set()
    for cells in _prompt_cells(table, column):
        for cell in cells:
            for text in prompt_texts(cell):
                chars.update(text)
    return chars


def rows_with(table, column: str, bad: set[str]) -> dict[int, list[str]]:
    """Row index -> the bad characters it holds (in order of first appearance)."""
    out: dict[int, list[str]] = {}
    row = 0
    for cells in _prompt_cells(table, column):
        for cell in cells:
            found = [c for c in dict.fromkeys("".join(prompt_texts(cell))) if c in bad]
            if found:
                out[row] = found
            row += 1
    return out


def describe_chars(chars: Iterable[str]) -> str:
    return ", ".join(f"{c!r} (U+{ord(c):04X})" for c in sorted(chars))


def known_chars(tokenizer) -> str | None:
    """The single-character tokens of a small vocabulary (the built-in alphabet), else None."""
    vocab = tokenizer.get_vocab()
    if len(vocab) > SMALL_VOCAB:
        return None
    return "".join(sorted(t for t in vocab if len(t) == 1))


def file_of_row(paths: list[str], row: int) -> tuple[str, int]:
    """(file, row within it) of a row of the concatenated table (datasets reads files in order)."""
    if len(paths) == 1:
        return paths[0], row
    import datasets

    from miniverl.data.files import LOADERS

    for path in paths:
        kind = LOADERS[Path(path).expanduser().suffix]
        n = len(datasets.load_dataset(kind, data_files=[str(Path(path).expanduser())], split="train"))
        if row < n:
            return path, row
        row -= n
    return paths[-1], row


def check_encodable(table, column: str, tokenizer, paths: list[str], field: str, allowed: int) -> list[int]:
    """Rows whose prompt the tokenizer cannot encode; refuses the run when there are more than `allowed`."""
    bad = unencodable_chars(tokenizer, table_chars(table, column))
    if not bad:
        return []
    rows = rows_with(table, column, bad)
    if len(rows) <= allowed:
        return sorted(rows)
    shown = []
    for row, chars in list(rows.items())[:SHOWN_ROWS]:
        path, local = file_of_row(paths, row)
        shown.append(f"{path} row {local} (from 0): {describe_chars(chars)}")
    alphabet = known_chars(tokenizer)
    knows = f" It knows only these characters: {alphabet!r}." if alphabet is not None else ""
    raise ConfigError(
        f"{field}: {len(rows)} prompt rows hold characters the student's tokenizer drops or turns into its"
        f" unknown token, so those prompts would train changed: {'; '.join(shown)}"
        f"{' and more' if len(rows) > SHOWN_ROWS else ''}.{knows} Use a student whose tokenizer covers them"
        f" (model.student.path), clean the file, or skip such rows with data.max_unencodable_rows={len(rows)}"
    )
