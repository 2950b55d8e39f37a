"""The examples stay runnable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_objectives_by_hand_runs():
    proc = subprocess.run(
        [sys.executable, "examples/objectives_by_hand.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "generalized JSD, beta=1.0" in proc.stdout and "GRPO:" in proc.stdout


@pytest.mark.slow
def test_distill_jsonl_runs_on_a_users_file(tmp_path, chat_student_dir, chat_teacher_dir):
    """The example end to end through Ray: plain jsonl with its own column names, chat template, evaluation."""
    rows = [{"question": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(24)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "examples/distill_jsonl.py",
            str(prompts),
            f"--student={chat_student_dir}",
            f"--teacher={chat_teacher_dir}",
            "--steps=2",
            "--prompt-key=question",
            "--answer-key=label",
            f"--out={out}",
            "data.prompts_per_step=2",
            "rollout.max_new_tokens=4",
            "model.lora.rank=4",
            "tracking=disabled",
            "tracking.progress_bar=false",
            "trainer.save_checkpoint=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "greedy accuracy" in proc.stdout and "<|im_start|>assistant" in proc.stdout
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 2} and samples[0]["data_source"] == "jsonl"
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval/accuracy/jsonl" in metrics[0] and metrics[-1]["data/overlong_filtered"] == 0


def test_distill_in_process_runs_the_workers_without_ray(tmp_path):
    """The three workers as plain objects, two steps on the built-in models (a copy of the shipped ones)."""
    proc = subprocess.run(
        [sys.executable, "examples/distill_in_process.py", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "before: {'eval/accuracy'" in proc.stdout and "step 0: reverse KL" in proc.stdout
    assert "after: {'eval/accuracy'" in proc.stdout


def test_distill_jsonl_refuses_a_bad_input_in_one_line(tmp_path):
    """A config error (here a prompt file that does not exist) is one line on stderr and exit status 1, as
    `python -m miniverl.main` prints it, not a traceback; nothing is written to --out."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "examples/distill_jsonl.py",
            str(tmp_path / "missing.jsonl"),
            "--student=a",
            "--teacher=b",
            f"--out={out}",
            "tracking=disabled",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("distill_jsonl: error: ") and "missing.jsonl" in lines[-1]
    assert not out.exists()
