"""Evaluation sample rows reach samples.jsonl and a wandb table."""

from __future__ import annotations

import json

from miniverl.observe.tracking import Tracker

ROWS = [
    {"data_source": "openai/gsm8k", "prompt": "q", "response": "#### 4", "ground_truth": "4", "reward": 1.0},
    {"data_source": "openai/gsm8k", "prompt": "r", "response": "5", "ground_truth": "4", "reward": 0.0},
]


def test_samples_go_to_jsonl_and_a_wandb_table(tmp_path):
    tracker = Tracker(tmp_path, {}, "offline", "miniverl-test", None, 2, False)
    tracker.log(0, {"eval/accuracy": 0.5}, advance=False)
    tracker.log_samples(0, ROWS)
    tracker.log_samples(2, ROWS[:1])
    tracker.log_samples(3, [])  # nothing to write: no empty table, no line
    tracker.finish({"status": "ok"})
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 0, 2] and lines[0]["response"] == "#### 4"
    tables = list((tmp_path / "wandb").rglob("*.table.json"))
    assert tables, "no wandb table was written"
