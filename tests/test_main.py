"""The user's command end to end: `python -m miniverl.main ...` through real Ray actors on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    voted = [x for x in lines[1:] if x["sampler_version_tokens"]]  # the version test's record matches the steps'
    armed = {name: sum(x[f"sampler_vs_{name}_armed"] for x in voted) for name in ("previous", "base")}
    assert summary["version_test"] == {"voted_steps": len(voted), "armed_steps": armed}
    gate = summary["conformance"]  # fp32 hf_cached (the default): the sampler computes what the learner computes
    assert gate["decision"] == "pass" and gate["tokens"] > 0 and gate["mean_gap"] < 1e-4
    assert "conformance gate: hf_cached vs learner" in proc.stdout
    assert lines[1]["probe_ran"] == 1  # the policy of the first step was probed (the gate's v0 refresh)
    assert all(x["probe_gap_max"] < 1e-3 for x in lines[1:] if x["probe_ran"])  # the rest: the served digest
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert any((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"


@pytest.mark.slow
def test_colocated_roles_compute_the_separate_actors_run_and_overlap_one_step_stale(tmp_path, student_dir, teacher_dir):
    """resources.colocate=true: rollout, scorer and learner in one actor (cluster/colocate.py). Strict sync gives the
    separate actors' run number for number (hf_cached, adapter handed over in-process); with trainer.staleness=1
    the next rollout runs beside the update on its own thread, in a process whose Python threads take turns at
    resources.switch_interval_ms; with the learner's decoder layers compiled (trainer.compile_layers) the one-behind
    run gives the eager one-behind run's numbers to fp32 rounding."""
    common = (*TINY, "+experiment=gkd", "trainer=smoke", "rollout=hf_cached", "tracking=disabled")
    models = (f"model.student.path={student_dir}", f"model.teacher.path={teacher_dir}")
    runs = {}
    for name, extra in (
        ("colocated", ("resources.colocate=true",)),
        ("separate", ()),
        ("stale", ("resources.colocate=true", "trainer.staleness=1", "resources.switch_interval_ms=0.5")),
        # one behind with compiled layers: the learner's calls and the rollout's graph captures take turns, and the
        # numbers are the eager one-behind run's to fp32 rounding (a strict compiled run adds nothing to that and
        # to tests/models/test_compiled.py's micro-batch equality, and cost a minute of the suite's critical path)
        ("stale-compiled", ("resources.colocate=true", "trainer.staleness=1", "trainer.compile_layers=true")),
    ):
        proc = run_main(*common, *models, *extra, f"hydra.run.dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert ("Colocated pid=" in proc.stdout + proc.stderr) == (name != "separate")
        assert ("Python switch interval 0.5 ms" in proc.stdout + proc.stderr) == (name == "stale")
        assert ("decoder layers compiled" in proc.stdout + proc.stderr) == name.endswith("compiled")
    for mine, theirs in zip(runs["colocated"], runs["separate"], strict=True):
        for key in ("loss", "reverse_kl", "grad_norm", "eval/reverse_kl", "policy_version"):
            assert mine.get(key) == theirs.get(key), (mine["step"], key)
    for eager, compiled in zip(runs["stale"], runs["stale-compiled"], strict=True):
        for key in ("loss", "reverse_kl", "grad_norm", "eval/reverse_kl", "policy_version"):
            if eager.get(key) is None:  # a key a line does not carry (eval lines have no loss): absent in both
                assert compiled.get(key) is None, (eager["step"], key)
            else:  # pytest >= 9.2 refuses approx(None) with a relative tolerance
                assert compiled.get(key) == pytest.approx(eager[key], rel=1e-3, abs=1e-5), (eager["step"], key)
    for name in ("stale", "stale-compiled"):
        stale = runs[name][1:]
        assert [x["staleness"] for x in stale] == [0, 1, 1] and [x["policy_version"] for x in stale] == [0, 0, 1]
        assert all(x["sampler_gap_mean"] < 1e-4 for x in stale), name


def test_unknown_experiment_fails_with_the_options():
    proc = run_main("+experiment=distill", timeout=120)
    assert proc.returncode != 0
    assert "experiment/distill" in proc.stderr and "gkd" in proc.stderr


def test_bad_values_fail_before_anything_starts(tmp_path):
    proc = run_main("trainer.total_steps=0", f"hydra.run.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert "miniverl: error: trainer.total_steps=0" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_lag_other_than_0_or_1_fails_before_ray(tmp_path):
    proc = run_main("+experiment=gkd", "trainer.staleness=2", f"hydra.run.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert "miniverl: error: trainer.staleness=2: use 0 (strict sync) or 1" in proc.stderr
    assert "Ray dashboard" not in proc.stdout  # before Ray started
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written


def test_a_second_run_into_the_same_directory_is_refused_at_start(tmp_path, student_dir, teacher_dir):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "summary.json").write_text('{"status": "finished"}')
    (tmp_path / ".hydra").mkdir()  # the old run's record, which export-verl reads
    record = {name: f"the old run's {name}\n" for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    for name, text in record.items():
        (tmp_path / ".hydra" / name).write_text(text)
    proc = run_main(
        f"model.student.path={student_dir}", f"model.teacher.path={teacher_dir}", *TINY, f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"the run directory {tmp_path} already holds a run (metrics.jsonl, summary.json)" in proc.stderr
    assert "trainer.resume=auto" in proc.stderr and "Ray dashboard" not in proc.stdout  # before Ray started
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'  # the old run's files are untouched
    assert (tmp_path / "summary.json").read_text() == '{"status": "finished"}'
    # Hydra wrote the refused command's .hydra/*.yaml before main ran (issue 17); now nothing is written
    assert {p.name: p.read_text() for p in (tmp_path / ".hydra").iterdir()} == record
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "metrics.jsonl", "summary.json"]  # no main.log


def test_a_gpu_run_writes_its_plan_before_ray_so_a_run_killed_from_outside_keeps_it(
    tmp_path, student_dir, teacher_dir, monkeypatch
):
    """fit-planner.md, 2026-12-06 16:18 UTC: the device's time ran out under a run at step 38, which wrote no
    summary.json, so its plan could not be set against what it measured. The plan goes to plan.json before Ray starts
    (here Ray's start fails, as a machine taken back would end it); summary.json keeps it too where the run gets to
    write one."""
    import dataclasses

    import miniverl.cluster.launch as launch
    import miniverl.setup.prepare as prepare
    from miniverl.main import train, written
    from tests.test_config import with_models

    planned = {"card_gib": 16.0, "device_peak_gib": 14.8, "actors": {}}  # the CPU plans nothing: a GPU's stands in
    real = prepare.prepare_run

    def with_plan(*args, **kwargs):
        resume, setup = real(*args, **kwargs)
        return resume, dataclasses.replace(setup, plan=planned)

    def taken_back(cfg, log):
        raise RuntimeError("the machine was taken back")

    monkeypatch.setattr(prepare, "prepare_run", with_plan)
    monkeypatch.setattr(launch, "start_ray", taken_back)
    cfg = with_models(student_dir, teacher_dir, "resources.device=cpu", "tracking=disabled")
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="taken back"):
        train(cfg, run, {}, lambda *_: None)
    assert json.loads((run / "plan.json").read_text()) == planned
    assert written(run) == ["plan.json"]  # no summary.json: the report reads the plan from here (bench/e2e_report.py)
    monkeypatch.setattr(prepare, "prepare_run", real)
    with pytest.raises(RuntimeError, match="taken back"):
        train(cfg, tmp_path / "cpu", {}, lambda *_: None)
    assert not (tmp_path / "cpu" / "plan.json").exists()  # no plan, no file


def start_main(*args: str) -> subprocess.Popen:
    """The driver as a shell job: its own process group, stdout and stderr into one pipe (`2>&1 | tee log`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "miniverl.main", *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_steps(proc: subprocess.Popen, metrics: Path, lines: int) -> None:
    import time

    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)


LONG_RUN = ("trainer.total_steps=200", "trainer.eval_every=0", "trainer.save_every=1000", "tracking=disabled")


@pytest.mark.slow
def test_a_group_signal_with_a_dead_tee_checkpoints_and_the_readme_resume_continues(tmp_path, student_dir, teacher_dir):
    """Issue 17, one run for four cases (each run through Ray costs ~30 s on 2 cores):
    - a signal to the whole process group (`timeout`, a scheduler; a terminal's Ctrl-C likewise) killed Ray's
      raylet, which shares the driver's group: "Attempting to recover lost objects", exit 1, no checkpoint;
    - `... 2>&1 | tee log` whose tee died with it: the next print raised BrokenPipeError, no summary.json;
    - the README's resume command then trained on the built-in task (data.train_files, chat_template reverted);
    - a refused command rewrote the run's .hydra/*.yaml."""
    import random
    import signal

    rng = random.Random(0)
    words = ["".join(rng.choice("abcd") for _ in range(rng.randint(2, 4))) for _ in range(40)]
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{w}>", "answer": w[::-1]}) + "\n" for w in words))
    run_dir = tmp_path / "run"
    first = [f"model.student.path={student_dir}", f"model.teacher.path={teacher_dir}", *TINY, *LONG_RUN]
    first += [f"data.train_files={prompts}", "data.chat_template=false", "tracking.plots=false"]
    proc = start_main(*first, f"hydra.run.dir={run_dir}")
    wait_for_steps(proc, run_dir / "metrics.jsonl", 3)  # step 0 eval + 2 steps
    os.killpg(proc.pid, signal.SIGTERM)  # the driver, Ray's raylet and GCS (the actors have groups of their own)
    proc.stdout.close()  # and tee is gone
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"].startswith(f"SIGTERM after step {last}")
    assert 2 <= last < 200 and summary["checkpoint"] == str(run_dir / "checkpoints" / f"step_{last:08d}")
    state = json.loads((run_dir / "checkpoints" / f"step_{last:08d}" / "state.json").read_text())
    assert state["step"] == last == state["policy_version"]  # saved by the learner after the signal

    resumed = run_main(f"hydra.run.dir={run_dir}", "trainer.resume=auto", f"trainer.total_steps={last + 1}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "under its run's config; set now: trainer.total_steps" in resumed.stdout
    assert "32 training and 8 evaluation prompts (columns prompt/answer, raw text)" in resumed.stdout
    record = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    saved = yaml.safe_load(record["config.yaml"])
    assert saved["data"]["train_files"] == [str(prompts)] and saved["data"]["chat_template"] is False
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"

    refused = run_main(f"hydra.run.dir={run_dir}", "trainer.resume=auto", "data.chat_template=true", timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert (
        "data.chat_template: False -> True" in refused.stderr and "trainer.resume_allow_changes=true" in refused.stderr
    )
    assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == record  # nothing touched


@pytest.mark.slow
def test_ctrl_c_while_the_actors_start_is_one_line(tmp_path, student_dir, teacher_dir):
    """Issue 17: Ctrl-C during actor start-up printed a 50-line KeyboardInterrupt traceback."""
    import signal

    args = [f"model.student.path={student_dir}", f"model.teacher.path={teacher_dir}", *TINY, "tracking=disabled"]
    proc = start_main(*args, f"hydra.run.dir={tmp_path / 'run'}")
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Ray dashboard" in line:  # Ray is up; the actors are starting
            break
    os.killpg(proc.pid, signal.SIGINT)
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "miniverl: SIGINT while starting: stopped before the first step, nothing to save" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]


def test_help_shows_miniverls_groups_and_the_first_commands():
    """Issue 17: --help printed Hydra's generic text."""
    proc = run_main("--help", timeout=120)
    assert proc.returncode == 0
    assert "python -m miniverl.main +experiment=gkd " in proc.stdout and "trainer.resume=auto" in proc.stdout
    assert (
        "experiment: gkd, gkd_4080" in proc.stdout
        and "rollout: auto, hf_cached, hf_reference, sglang, vllm" in proc.stdout
    )
