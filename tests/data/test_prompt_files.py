"""Prompt files: verl parquet and plain jsonl through `datasets`, chat templates, and the prompt stream."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from miniverl.data.files import Columns, verl_rows
from miniverl.data.stream import FilePromptSource
from miniverl.data.templates import encode_prompt
from miniverl.errors import ConfigError
from tests.chat_models import gsm8k_rows, write_jsonl, write_parquet

LONG = 400  # a prompt limit no fixture prompt reaches


@pytest.fixture(scope="module")
def chat_tok(chat_student_dir):
    return AutoTokenizer.from_pretrained(str(chat_student_dir))


def source(tok, train, val=(), limit=LONG, overlong="filter", shuffle=True, eval_prompts=4, seed=0, **cols):
    return FilePromptSource(
        [str(p) for p in train],
        [str(p) for p in val],
        Columns(**cols),
        tok,
        True,
        limit,
        overlong,
        shuffle,
        eval_prompts,
        seed,
    )


def test_verl_parquet_rows_keep_the_schema(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", gsm8k_rows(3))
    rows = list(verl_rows([str(path)]))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["0", "2", "4"]
    assert rows[1]["data_source"] == "openai/gsm8k" and rows[1]["ability"] == "math"
    assert rows[1]["prompt"][0]["role"] == "user" and rows[1]["extra_info"]["index"] == 1


def test_plain_jsonl_maps_columns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "2+2?", "label": 4}, {"question": "1+1?", "label": 2}])
    rows = list(verl_rows([str(path)], Columns(prompt_key="question", answer_key="label")))
    assert rows[0]["prompt"] == [{"role": "user", "content": "2+2?"}]
    assert rows[0]["reward_model"]["ground_truth"] == "4" and rows[0]["data_source"] == "jsonl"


def test_missing_prompt_column_names_the_columns_and_the_key(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "2+2?"}])
    with pytest.raises(ConfigError, match=r"no column 'prompt' \(columns: question\); set data.prompt_key"):
        list(verl_rows([str(path)]))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("p.csv", "a,b\n", "ending in .jsonl"),
        ("p.jsonl", "{not json\n", r"p.jsonl line 1 is not valid JSON \(Expecting property name .* at column 2\)"),
        ("p.jsonl", "", r"data.train_files: .*p.jsonl is empty \(0 bytes\)"),  # was a bare "StopIteration: "
        ("p.jsonl", "\n\n", r"p.jsonl holds only blank lines"),
        ("p.parquet", "", r"p.parquet is empty"),
        # latin-1 bytes: datasets accepted the file and raised UnicodeDecodeError at the first read of the row
        ("p.jsonl", b'{"prompt": "ok>"}\n{"prompt": "caf\xe9>"}\n', r"p.jsonl line 2 is not UTF-8 text \(byte 0xe9"),
    ],
)
def test_bad_files_name_the_key(tmp_path, name, content, message):
    if isinstance(content, bytes):
        (tmp_path / name).write_bytes(content)
    else:
        (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=message):
        list(verl_rows([str(tmp_path / name)]))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train_files: .*nowhere.jsonl does not exist"):
        list(verl_rows([str(tmp_path / "nowhere.jsonl")]))


def test_a_directory_is_named_as_one_with_the_files_to_pass(tmp_path):
    """Issue 38: a directory was reported as "does not exist"."""
    write_parquet(tmp_path / "train.parquet", gsm8k_rows(2))
    with pytest.raises(ConfigError) as info:
        list(verl_rows([str(tmp_path)]))
    assert str(info.value) == (
        f"data.train_files: {tmp_path} is a directory, not a prompt file (it holds train.parquet); pass the files"
        f" themselves, e.g. data.train_files=[{tmp_path}/train.parquet]"
    )


GOOD = {"prompt": "2+2?", "answer": "4"}


def jsonl_lines(path, *lines: str):
    """A prompt file of `lines`, one JSON text each, after a good row and a blank line (so row 1 is line 3)."""
    path.write_text("\n".join([json.dumps(GOOD), "", *lines]) + "\n")
    return [str(path)]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": null, "answer": "4"}', "prompt is null"),  # trained as the text "None"
        ('{"prompt": "", "answer": "4"}', "prompt is an empty string"),
        ('{"prompt": "  ", "answer": "4"}', "prompt is only whitespace"),
        ('{"prompt": 12, "answer": "4"}', r"prompt is a number \(12\), not text"),  # trained as "12"
        ('{"prompt": ["a", "b"], "answer": "4"}', r"prompt message 0 is \"a\", not a \{role, content\} message"),
        ('{"prompt": [], "answer": "4"}', "prompt is an empty list of messages"),
        (
            '{"prompt": [{"role": "user", "content": null}], "answer": "4"}',
            r'prompt message 0 is \{"role": "user", "content": null\}, not',
        ),
        ('{"prompt": [{"role": "user", "content": ""}], "answer": "4"}', "prompt holds only empty messages"),
        ('{"prompt": {"text": "hi"}, "answer": "4"}', r"prompt is an object \(\{\"text\": \"hi\"\}\), not text"),
    ],
)
def test_a_prompt_that_is_not_text_or_messages_is_refused_by_line(tmp_path, line, problem):
    """Issue 38: such rows trained as a literal string (str(None), str(12), str(["a", "b"])) or as an empty prompt."""
    with pytest.raises(
        ConfigError, match=rf"^data.train_files: \S+/p.jsonl line 3: {problem}.*; give the row a prompt"
    ):
        list(verl_rows(jsonl_lines(tmp_path / "p.jsonl", line)))


def test_a_bad_row_is_named_in_its_own_file_with_a_count(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD] * 3)
    bad = jsonl_lines(tmp_path / "bad.jsonl", '{"prompt": null, "answer": "1"}', '{"prompt": "", "answer": "2"}')
    with pytest.raises(ConfigError, match=r"bad.jsonl line 3: prompt is null; .* or remove it \(1 more row like it\)$"):
        list(verl_rows([str(good), *bad]))
    parquet = write_parquet(tmp_path / "p.parquet", [GOOD, {"prompt": None, "answer": "4"}])
    with pytest.raises(ConfigError, match=r"p.parquet row 1 \(from 0\): prompt is null"):
        list(verl_rows([str(parquet)]))


def test_no_answer_column_is_refused_unless_the_run_says_there_are_no_answers(tmp_path, chat_tok):
    """Issue 38: the start line said "columns prompt/answer" and the run reported accuracy 0.000."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+{i}?", "label": str(2 * i)} for i in range(6)])
    with pytest.raises(ConfigError) as info:
        list(verl_rows([str(path)]))
    assert str(info.value) == (
        f"data.train_files: {path} has no answer column 'answer' (columns: prompt, label); set"
        " data.answer_key=<column>, or data.answer_key='' if the prompts have no answers (distillation needs none;"
        " task accuracy then means nothing)"
    )
    assert [r["reward_model"]["ground_truth"] for r in verl_rows([str(path)], Columns(answer_key="label"))][1] == "2"
    assert {r["reward_model"]["ground_truth"] for r in verl_rows([str(path)], Columns(answer_key=""))} == {""}
    with_answers = source(chat_tok, [write_jsonl(tmp_path / "a.jsonl", [GOOD] * 6)], eval_prompts=2).describe()
    assert with_answers == "4 training and 2 evaluation prompts (columns prompt/answer, chat template)"
    assert source(chat_tok, [path], eval_prompts=2, answer_key="").describe() == (
        "4 training and 2 evaluation prompts (column prompt, chat template); no answers (data.answer_key=''): every"
        " ground truth is empty, so task accuracy reads 0 and means nothing"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "1+1?", "answer": null}', r"p.jsonl line 3: answer is null; give the row an answer"),
        ('{"prompt": "1+1?"}', r"p.jsonl line 3: answer is null"),  # the key left out of one row
        ('{"prompt": "1+1?", "answer": ""}', r"p.jsonl line 3: answer is empty"),
        ('{"prompt": "1+1?", "answer": [2]}', r"p.jsonl line 3: answer is a list \(\[2\]\), not text or a number"),
    ],
)
def test_a_row_without_an_answer_is_refused_by_line(tmp_path, line, message):
    """Issue 38: such rows were scored against an empty answer (str(None) -> "")."""
    with pytest.raises(ConfigError, match=message):
        list(verl_rows(jsonl_lines(tmp_path / "p.jsonl", line)))


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ([4, 2.5], r"line 1: answer 4 would be read as 4.0 \(datasets reads .* write every answer as text"),
        (["1.50", 4], r'line 1: answer "1.50" would be read as 1.5'),  # a column of mixed JSON types
        (["true", "x", 4], r'line 1: answer "true" would be read as true'),
    ],
)
def test_an_answer_datasets_would_change_is_refused(tmp_path, answers, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "answer": a} for a in answers])
    with pytest.raises(ConfigError, match=rf"data.train_files: \S+/p.jsonl {message}"):
        list(verl_rows([str(path)]))
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "q", "answer": a} for a in ["3/4", 4, "12"]])
    assert [r["reward_model"]["ground_truth"] for r in verl_rows([str(same)])] == ["3/4", "4", "12"]


def test_a_blank_line_in_a_file_of_mixed_columns_is_named(tmp_path):
    """datasets 5 raises a bare "ValueError: Expected object or value" on such a file."""
    with pytest.raises(ConfigError, match=r"p.jsonl line 2 is blank and column 'answer' mixes JSON types \(line 1:"):
        list(verl_rows(jsonl_lines(tmp_path / "p.jsonl", '{"prompt": "1+1?", "answer": 2}')))


def test_answers_null_in_every_row_point_at_the_key(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1?", "answer": None}] * 3)
    with pytest.raises(ConfigError, match=r"answer is null in every row of \S+/p.jsonl; set data.answer_key to the"):
        list(verl_rows([str(path)]))
    rows = gsm8k_rows(3)
    rows[1]["reward_model"]["ground_truth"] = None
    with pytest.raises(ConfigError, match=r"t.parquet row 1 \(from 0\): reward_model.ground_truth is null"):
        list(verl_rows([str(write_parquet(tmp_path / "t.parquet", rows))]))


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"prompt": "a" "answer": "1"}', r"line 3 is not valid JSON \(Expecting ',' delimiter at column 16\)"),
        ('{"prompt": "a", "prompt": "b", "answer": "1"}', r"line 3 is not valid JSON \(key 'prompt' appears twice"),
        (
            '{"prompt": [{"role": "user", "role": "system", "content": "x"}], "answer": "1"}',
            r"line 3 is not valid JSON \(key 'role' appears twice",
        ),
        ('{"prompt": "a", "answer": "1"} {"prompt": "b", "answer": "2"}', r"line 3 is not valid JSON \(Extra data"),
        ('["a", "1"]', r"line 3 holds a list, not a JSON object"),
    ],
)
def test_a_bad_json_line_is_named_with_its_reason(tmp_path, line, reason):
    """Issue 38: pyarrow's "JSON parse error ... in row 1" named neither the file nor the line; a repeated key
    was refused without saying which."""
    with pytest.raises(ConfigError, match=rf"data.train_files: \S+/p.jsonl {reason}"):
        list(verl_rows(jsonl_lines(tmp_path / "p.jsonl", line)))


def test_json_documents_still_read(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps([GOOD, {"prompt": "1+1?", "answer": 2}], indent=2))
    assert [r["reward_model"]["ground_truth"] for r in verl_rows([str(array)])] == ["4", "2"]
    pretty = tmp_path / "p.json"
    pretty.write_text("\ufeff" + json.dumps(GOOD, indent=2))
    assert [r["prompt"][0]["content"] for r in verl_rows([str(pretty)])] == ["2+2?"]
    array.write_text('[\n{"prompt": "a",\n "prompt": "b", "answer": "1"}]')
    with pytest.raises(ConfigError, match=r"a.json is not valid JSON \(key 'prompt' appears twice"):
        list(verl_rows([str(array)]))
    array.write_text('[\n{"prompt": "a",\n "answer": "1"},\n]')
    with pytest.raises(ConfigError, match=r"a.json is not valid JSON \(line 4, Expecting value at column 1\)"):
        list(verl_rows([str(array)]))
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"prompt": "a"\n{"prompt": "b", "answer": "1"}\n')  # a broken first row, not a document
    with pytest.raises(ConfigError, match=r"b.jsonl line 1 is not valid JSON \(Expecting ',' delimiter"):
        list(verl_rows([str(broken)]))


def test_chat_template_wraps_the_prompt_and_opens_the_answer(chat_tok):
    ids = encode_prompt(chat_tok, [{"role": "user", "content": "What is 2 + 2?"}], True)
    text = chat_tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nWhat is 2 + 2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    raw = encode_prompt(chat_tok, [{"role": "user", "content": "What is 2 + 2?"}], False)
    assert chat_tok.decode(raw) == "What is 2 + 2?"


def test_template_errors_say_which_switch(chat_tok, student_dir):
    char_tok = AutoTokenizer.from_pretrained(str(student_dir))  # the built-in tokenizer has no template
    with pytest.raises(ConfigError, match="no chat template; set data.chat_template=false"):
        encode_prompt(char_tok, [{"role": "user", "content": "ab>"}], True)
    two = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ConfigError, match="set data.chat_template=true"):
        encode_prompt(chat_tok, two, False)


def test_stream_is_a_pure_function_of_seed_and_step(tmp_path, chat_tok):
    path = write_parquet(tmp_path / "t.parquet", gsm8k_rows(20))
    a, b = source(chat_tok, [path]), source(chat_tok, [path])
    late = b.batch(7, 3)  # a "restarted" run asks for step 7 first
    for step in range(8):
        a.batch(step, 3)
    assert a.batch(7, 3) == late
    assert source(chat_tok, [path], seed=1).batch(7, 3).prompt_ids != late.prompt_ids


def test_epochs_cover_every_training_row_once_in_a_new_order(tmp_path, chat_tok):
    path = write_parquet(tmp_path / "t.parquet", gsm8k_rows(14))
    s = source(chat_tok, [path], eval_prompts=4)  # 10 training rows, 2 per step: an epoch is 5 steps
    truths = [[t for step in range(e * 5, e * 5 + 5) for t in s.batch(step, 2).ground_truth] for e in range(2)]
    held_out = set(s.eval_batch(4).ground_truth)
    assert sorted(truths[0]) == sorted(truths[1]) and len(set(truths[0])) == 10
    assert truths[0] != truths[1]  # reshuffled
    assert not held_out & set(truths[0]) and len(held_out) == 4


def test_file_order_without_shuffle_and_val_files(tmp_path, chat_tok):
    train = write_parquet(tmp_path / "t.parquet", gsm8k_rows(6))
    val = write_parquet(tmp_path / "v.parquet", gsm8k_rows(3, source="lighteval/MATH"))
    s = source(chat_tok, [train], [val], shuffle=False)
    assert s.batch(0, 3).ground_truth == ["0", "2", "4"] and s.batch(2, 3).ground_truth == ["0", "2", "4"]
    assert s.eval_batch(10).data_source == ["lighteval/MATH"] * 3


def test_overlong_prompts_are_filtered_and_counted_never_cut(tmp_path, chat_tok):
    rows = gsm8k_rows(8)
    for r in rows[::2]:  # every other prompt gets far longer than the limit
        r["prompt"][0]["content"] += " step" * 80
    path = write_parquet(tmp_path / "t.parquet", rows)
    limit = 150
    s = source(chat_tok, [path], val=[path], limit=limit)
    batch = s.batch(0, 4)
    assert all(len(ids) <= limit for ids in batch.prompt_ids)
    assert sorted(batch.ground_truth) == ["10", "14", "2", "6"] and s.overlong_count == 4
    s.batch(3, 4)
    assert s.overlong_count == 4  # each row is counted once, not once per epoch
    with pytest.raises(
        ConfigError, match=r"has \d+ tokens, more than data.max_prompt_length=150.*data.overlong=filter"
    ):
        source(chat_tok, [path], limit=limit, overlong="error", shuffle=False).batch(0, 4)


def test_every_prompt_over_the_limit_stops(tmp_path, chat_tok):
    path = write_parquet(tmp_path / "t.parquet", gsm8k_rows(6))
    with pytest.raises(
        ConfigError,
        match=r"every training prompt is longer .* \(the shortest, after the chat template, has \d+\); raise"
        r" data.max_prompt_length to at least \d+",
    ):
        source(chat_tok, [path], limit=5, eval_prompts=1).batch(0, 2)


def test_tokenization_is_lazy(tmp_path, chat_tok, monkeypatch):
    import miniverl.data.stream as stream

    path = write_parquet(tmp_path / "t.parquet", gsm8k_rows(200))
    calls = []
    real = stream.encode_prompt
    monkeypatch.setattr(stream, "encode_prompt", lambda *a: calls.append(1) or real(*a))
    s = source(chat_tok, [path], eval_prompts=4)
    s.batch(0, 4)
    assert len(calls) <= 8  # step 0's four prompts, checked then encoded; not the 196 other rows


def test_too_few_rows_to_hold_out(tmp_path, chat_tok):
    path = write_parquet(tmp_path / "t.parquet", gsm8k_rows(3))
    with pytest.raises(ConfigError, match="lower data.eval_prompts or pass data.val_files"):
        source(chat_tok, [path], eval_prompts=3)
