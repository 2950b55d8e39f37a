"""The user's command end to end: `python -m miniverl.main ...` through real Ray actors on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true", "RAY_DEDUP_LOGS": "0"}
TINY = (
    "data.min_len=2",
    "data.max_len=4",
    "data.prompts_per_step=4",
    "data.eval_prompts=8",
    "rollout.max_new_tokens=6",
    "tracking.progress_bar=false",
)


def run_main(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miniverl.main", *args],
        cwd=ROOT,
        env=ENV,
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
    # The dashboard starts exactly when Ray's optional dashboard packages import (ray[default]).
    try:
        import ray.dashboard.optional_deps  # noqa: F401

        expected = "Ray dashboard: http://"
    except ImportError:
        expected = "Ray dashboard: not running"
    assert expected in proc.stdout, proc.stdout[-2000:]
    assert "reverse KL to teacher" in proc.stdout and "greedy task accuracy" in proc.stdout
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]  # eval before training, then one line per step
    for key in ("loss", "reverse_kl", "sampler_gap_mean", "accuracy", "time/generate", "time/update", "time/refresh"):
        assert key in lines[1], key
    assert [x["policy_version"] for x in lines[1:]] == [0, 1, 2]
    assert "eval/reverse_kl" in lines[-1] and "eval/accuracy" in lines[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["end_reverse_kl"] == lines[-1]["eval/reverse_kl"]
    assert summary["status"] == "finished"
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert summary["checkpoint"] == str(checkpoint)
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["step"] == 3 and state["policy_version"] == 3 and state["miniverl_version"]
    assert state["config"]["model"]["lora"]["rank"] == 32 and len(state["config_hash"]) == 64
    for name in ("adapter/adapter_config.json", "optimizer.pt", "rng.pt"):
        assert name in state["files"] and (checkpoint / name).exists(), name
    for png in ("reverse_kl.png", "accuracy.png", "step_time.png"):
        assert (run_dir / png).stat().st_size > 0, png
    gate = summary["conformance"]  # fp32 hf_reference: the sampler computes what the learner computes
    assert gate["decision"] == "pass" and gate["tokens"] > 0 and gate["mean_gap"] < 1e-4
    assert "conformance gate: hf_reference vs learner" in proc.stdout
    assert all(x["probe_gap_max"] < 1e-3 for x in lines[1:])
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


def test_a_second_run_into_the_same_directory_is_refused_at_start(tmp_path, student_dir, teacher_dir):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "summary.json").write_text('{"status": "finished"}')
    proc = run_main(
        f"model.student.path={student_dir}", f"model.teacher.path={teacher_dir}", *TINY, f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"the run directory {tmp_path} already holds a run (metrics.jsonl, summary.json)" in proc.stderr
    assert "trainer.resume=auto" in proc.stderr and "Ray dashboard" not in proc.stdout  # before Ray started
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'  # the old run's files are untouched
    assert (tmp_path / "summary.json").read_text() == '{"status": "finished"}'


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_last_completed_step_and_exits_130(tmp_path, student_dir, teacher_dir):
    import signal
    import time

    run_dir = tmp_path / "run"
    args = [f"model.student.path={student_dir}", f"model.teacher.path={teacher_dir}", *TINY]
    args += ["trainer.total_steps=200", "trainer.eval_every=0", "trainer.save_every=1000", "tracking=disabled"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "miniverl.main", *args, "tracking.plots=false", f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # step 0 eval + 2 steps
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the driver
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert 2 <= last < 200
    assert f"SIGINT after step {last}" in err and "trainer.resume=auto" in err
    state = json.loads((run_dir / "checkpoints" / f"step_{last:08d}" / "state.json").read_text())
    assert state["step"] == last == state["policy_version"]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
