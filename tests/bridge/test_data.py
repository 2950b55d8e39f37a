"""Prompt data in verl's parquet schema: the run's own prompts, jsonl input, and an identical round trip."""

from __future__ import annotations

import json

import pytest

from miniverl.bridge import data
from miniverl.data.prompts import PromptSource
from miniverl.errors import ConfigError


class _CharTokenizer:
    """One id per character (its code point): the parts of a Hugging Face tokenizer the prompt stream uses,
    including the round-trip check of every prompt character (miniverl/data/charset.py)."""

    unk_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(ch) for ch in text]}

    def decode(self, ids, **_kwargs):
        return "".join(map(chr, ids))

    def get_vocab(self):
        return {chr(i): i for i in range(1024)}  # large: a refusal does not list it


_char_tokenizer = _CharTokenizer()


def test_task_rows_are_the_prompts_the_run_trains_on():
    source = PromptSource("reverse", 3, 8, _char_tokenizer, max_prompt_length=32, seed=5)
    rows = data.task_rows("reverse", 3, 8, seed=5, steps=3, groups=4)
    assert len(rows) == 12
    for step in range(3):
        batch = source.batch(step, 4)
        got = rows[step * 4 : step * 4 + 4]
        assert [r["extra_info"]["uid"] for r in got] == batch.uid
        assert [r["reward_model"]["ground_truth"] for r in got] == batch.ground_truth
        assert [_char_tokenizer(r["prompt"][0]["content"])["input_ids"] for r in got] == batch.prompt_ids
    assert [r["extra_info"]["index"] for r in rows] == list(range(12))


def test_eval_rows_are_the_run_evaluation_prompts():
    source = PromptSource("addition", 1, 3, _char_tokenizer, max_prompt_length=32, seed=2)
    batch = source.eval_batch(6)
    rows = data.task_eval_rows("addition", 1, 3, seed=2, count=6)
    assert [r["reward_model"]["ground_truth"] for r in rows] == batch.ground_truth
    assert [r["extra_info"]["uid"] for r in rows] == batch.uid
    # the task's name, as miniVERL's own rows carry it (reward.name=auto routes it to exact_match)
    assert rows[0]["data_source"] == batch.data_source[0] == "addition" and rows[0]["ability"] == "addition"
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["reward_model"]["style"] == "rule"


def test_round_trip_is_identical(tmp_path):
    rows = data.task_rows("reverse", 3, 8, seed=0, steps=2, groups=5)
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert data.write_parquet(rows, first) == 10
    back = data.read_parquet(first)
    assert back == rows
    data.write_parquet(back, second)
    assert data.read_parquet(second) == rows
    assert first.read_bytes() == second.read_bytes()


def test_jsonl_rows(tmp_path):
    f = tmp_path / "qa.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"{i}+1=", "label": i + 1, "other": "x"}) for i in range(3)))
    rows = data.jsonl_rows(f, "question", "label")
    assert [r["prompt"][0]["content"] for r in rows] == ["0+1=", "1+1=", "2+1="]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1", "2", "3"]
    assert rows[2]["data_source"] == "qa" and rows[2]["extra_info"] == {"index": 2, "split": "train", "uid": "qa-2"}
    out = tmp_path / "qa.parquet"
    data.write_parquet(rows, out)
    assert data.read_parquet(out) == rows


def test_jsonl_missing_column_names_the_flag(tmp_path):
    f = tmp_path / "qa.jsonl"
    f.write_text(json.dumps({"q": "a", "a": "b"}) + "\n")
    with pytest.raises(ConfigError, match="no column 'prompt'.*--prompt-key"):
        data.jsonl_rows(f, "prompt", "a")
    with pytest.raises(ConfigError, match="no such jsonl file"):
        data.jsonl_rows(tmp_path / "missing.jsonl", "q", "a")


def test_bad_rows_are_refused_before_writing(tmp_path):
    row = data.make_row("s", "p", "a", "t", 0, "train", "u")
    del row["ability"]
    out = tmp_path / "bad.parquet"
    with pytest.raises(ConfigError, match="exactly the keys"):
        data.write_parquet([row], out)
    bad = data.make_row("s", "p", "a", "t", 0, "train", "u")
    bad["prompt"] = []
    with pytest.raises(ConfigError, match="prompt must be a non-empty list"):
        data.write_parquet([bad], out)
    with pytest.raises(ConfigError, match="no rows"):
        data.write_parquet([], out)
    assert not out.exists()


def test_read_refuses_other_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["a"]}), str(f))
    with pytest.raises(ConfigError, match="missing columns data_source"):
        data.read_parquet(f)


def test_a_runs_prompt_files_round_trip_through_miniverls_own_reader(tmp_path):
    """data.train_files rows export as verl rows; miniVERL reads the export back as a prompt file and exports
    the same rows again, and the held-out split is the one the run evaluates on."""
    from miniverl.config import MiniVerlConfig
    from miniverl.data.stream import holdout_split

    src = tmp_path / "qa.jsonl"
    lines = [
        {"question": f"{i}+{i}=", "answer": str(2 * i), "data_source": "gsm8k" if i % 2 else "qa"} for i in range(9)
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines))
    cfg = MiniVerlConfig()
    cfg.data.train_files, cfg.data.prompt_key, cfg.data.eval_prompts, cfg.data.seed = [str(src)], "question", 3, 4
    first = data.prompt_rows(cfg)
    held, _ = holdout_split(9, 3, 4)
    assert [r["reward_model"]["ground_truth"] for r in first["test"]] == [lines[i]["answer"] for i in held]
    assert len(first["train"]) == 6 and {r["data_source"] for r in first["train"]} == {"gsm8k", "qa"}
    exported = tmp_path / "train.parquet"
    data.write_parquet(first["train"] + first["test"], exported)
    again = MiniVerlConfig()
    again.data.train_files, again.data.val_files = [str(exported)], [str(exported)]
    back = data.prompt_rows(again)["train"]
    assert [(r["prompt"], r["reward_model"], r["data_source"]) for r in back] == [
        (r["prompt"], r["reward_model"], r["data_source"]) for r in first["train"] + first["test"]
    ]
    second = tmp_path / "again.parquet"
    data.write_parquet(back, second)
    assert data.read_parquet(second) == back


def test_a_file_run_exports_the_stream_it_draws(tmp_path):
    """With the student's tokenizer the export is the run's own stream: its seeded per-epoch shuffle over
    more than one epoch, its over-long filter, total_steps x prompts_per_step rows in step order, and the
    held-out prompts that fit, with the run's uids."""
    from miniverl.config import MiniVerlConfig
    from miniverl.data.build import build_prompt_source

    src = tmp_path / "qa.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": "x" * (i % 7 + 1), "answer": str(i)}) for i in range(20)))
    cfg = MiniVerlConfig()
    d = cfg.data
    d.train_files, d.chat_template, d.max_prompt_length, d.eval_prompts, d.prompts_per_step = [str(src)], False, 5, 3, 4
    cfg.trainer.total_steps = 5  # 20 rows over 17 training rows, 5 too long: three epochs
    rows = data.prompt_rows(cfg, _char_tokenizer)
    source = build_prompt_source(d, _char_tokenizer, cfg.trainer.total_steps, log=lambda _: None)
    ours = [source.batch(step, 4) for step in range(5)]
    assert [r["extra_info"]["uid"] for r in rows["train"]] == [u for b in ours for u in b.uid]
    assert [r["reward_model"]["ground_truth"] for r in rows["train"]] == [a for b in ours for a in b.ground_truth]
    assert [_char_tokenizer(r["prompt"][0]["content"])["input_ids"] for r in rows["train"]] == [
        ids for b in ours for ids in b.prompt_ids
    ]
    assert len(set(r["reward_model"]["ground_truth"] for r in rows["train"])) < 20  # rows repeat across epochs
    held = source.eval_batch(3)
    assert [r["reward_model"]["ground_truth"] for r in rows["test"]] == held.ground_truth
    assert [r["extra_info"]["uid"] for r in rows["test"]] == held.uid


def test_a_file_run_with_val_files_exports_the_val_prompts_that_fit(tmp_path):
    from miniverl.config import MiniVerlConfig
    from miniverl.data.build import build_prompt_source

    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": "ab" * (i % 3 + 1), "answer": str(i)}) for i in range(6)))
    val.write_text("\n".join(json.dumps({"prompt": "x" * (i + 1), "answer": f"v{i}"}) for i in range(8)))
    cfg = MiniVerlConfig()
    d = cfg.data
    d.train_files, d.val_files, d.chat_template, d.max_prompt_length = [str(train)], [str(val)], False, 4
    d.eval_prompts, d.prompts_per_step, cfg.trainer.total_steps = 5, 2, 3
    rows = data.prompt_rows(cfg, _char_tokenizer)
    held = build_prompt_source(d, _char_tokenizer, 3, log=lambda _: None).eval_batch(5)
    assert [r["reward_model"]["ground_truth"] for r in rows["test"]] == held.ground_truth == ["v0", "v1", "v2", "v3"]
    assert len(rows["train"]) == 6 and all(len(r["prompt"][0]["content"]) <= 4 for r in rows["train"])
