"""Issue 17: a prompt the student's tokenizer cannot encode is refused, never trained changed."""

from __future__ import annotations

import json

import pytest

from miniverl.data.charset import unencodable_chars
from miniverl.data.files import Columns
from miniverl.data.stream import FilePromptSource
from miniverl.errors import ConfigError
from miniverl.models.tokenizer import save_char_tokenizer


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_char_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def write_rows(path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": p[:-1][::-1]}) + "\n" for p in prompts))
    return str(path)


def source(train: list[str], tokenizer, allowed: int = 0, val: list[str] = ()) -> FilePromptSource:
    return FilePromptSource(list(train), list(val), Columns(), tokenizer, False, 32, "filter", True, 4, 0, allowed)


def test_the_builtin_alphabet_round_trips_and_other_characters_do_not(char_tokenizer):
    from miniverl.data.tasks import TASK_ALPHABET

    assert unencodable_chars(char_tokenizer, TASK_ALPHABET) == set()
    assert unencodable_chars(char_tokenizer, "éK .") == {"é", "K", " ", "."}


def test_unencodable_prompts_are_refused_naming_file_row_and_characters(tmp_path, char_tokenizer):
    """`café>` trained as `<bos>caf>` and `Krvymfx x>` as `<bos>rvymfxx>`: greedy accuracy 0.000."""
    good = write_rows(tmp_path / "good.jsonl", ["abc>"] * 10)
    bad = write_rows(tmp_path / "bad.jsonl", ["abc>", "café>", "Krvymfx x>"])
    with pytest.raises(ConfigError) as info:
        source([good, bad], char_tokenizer)
    message = str(info.value)
    assert message.startswith("data.train_files: 2 prompt rows hold characters the student's tokenizer drops")
    assert f"{bad} row 1 (from 0): 'é' (U+00E9)" in message  # the row inside its own file, not the concatenation
    assert f"{bad} row 2 (from 0): ' ' (U+0020), 'K' (U+004B)" in message
    assert "'+0123456789=>abcdefghijklmnopqrstuvwxyz'" in message and "data.max_unencodable_rows=2" in message
    val = write_rows(tmp_path / "val.jsonl", ["ab>", "aé>"])
    with pytest.raises(ConfigError, match=r"data.val_files: 1 prompt rows .*/val.jsonl row 1"):
        source([good], char_tokenizer, val=[val])


def test_up_to_the_threshold_such_rows_are_skipped_and_counted(tmp_path, char_tokenizer):
    rows = ["abc>", "café>", "ba>", "Krvymfx x>"] + ["cab>"] * 8
    stream = source([write_rows(tmp_path / "p.jsonl", rows)], char_tokenizer, allowed=2)
    assert stream.unencodable_count == 2 and "2 unencodable rows skipped" in stream.describe()
    seen = [char_tokenizer.decode(ids) for step in range(3) for ids in stream.batch(step, 4).prompt_ids]
    seen += [char_tokenizer.decode(ids) for ids in stream.eval_batch(4).prompt_ids]
    assert not any("caf" in s or "rvymf" in s for s in seen)  # never trained changed


def test_a_byte_level_tokenizer_keeps_every_character(chat_student_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_student_dir))
    assert unencodable_chars(tok, "café Krvymfx x> \t\n日本語🙂") == set()
