"""The user's command end to end: `python -m miniverl.main ...` through real Ray actors on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_main(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true", "RAY_DEDUP_LOGS": "0"}
    return subprocess.run(
        [sys.executable, "-m", "miniverl.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_gkd_runs_through_ray_actors(tmp_path, student_dir, teacher_dir):
    run_dir = tmp_path / "run"
    proc = run_main(
        "+experiment=gkd",
        "trainer=smoke",
        f"model.student.path={student_dir}",
        f"model.teacher.path={teacher_dir}",
        "data.min_len=2",
        "data.max_len=4",
        "data.prompts_per_step=4",
        "data.eval_prompts=8",
        "rollout.max_new_tokens=6",
        "tracking.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Ray dashboard:" in proc.stdout
    assert "reverse KL to teacher" in proc.stdout and "greedy task accuracy" in proc.stdout
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]  # eval before training, then one line per step
    for key in ("loss", "reverse_kl", "sampler_gap_mean", "accuracy", "time/generate", "time/update", "time/refresh"):
        assert key in lines[1], key
    assert [x["policy_version"] for x in lines[1:]] == [0, 1, 2]
    assert "eval/reverse_kl" in lines[-1] and "eval/accuracy" in lines[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["end_reverse_kl"] == lines[-1]["eval/reverse_kl"]
    gate = summary["conformance"]  # fp32 hf_reference: the sampler computes what the learner computes
    assert gate["decision"] == "pass" and gate["tokens"] > 0 and gate["mean_gap"] < 1e-4
    assert "conformance gate: hf_reference vs learner" in proc.stdout
    assert all(x["probe_gap_max"] < 1e-3 for x in lines[1:])
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3
    assert (run_dir / "checkpoint" / "adapter" / "adapter_config.json").exists()
    assert (run_dir / "checkpoint" / "optimizer.pt").exists()
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert any((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"


def test_unknown_experiment_fails_with_the_options():
    proc = run_main("+experiment=distill", timeout=120)
    assert proc.returncode != 0
    assert "experiment/distill" in proc.stderr and "gkd" in proc.stderr


def test_bad_values_fail_before_anything_starts(tmp_path):
    proc = run_main("trainer.total_steps=0", f"hydra.run.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert "miniverl: error: trainer.total_steps=0" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
