"""Issue 76: one run per directory. Two runs started in one directory seconds apart both passed the "already holds
a run" check and trained into the same metrics.jsonl; the second is now refused in one line naming the first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from miniverl.errors import ConfigError
from miniverl.run_lock import LOCK_FILE, RunLock

ROOT = Path(__file__).resolve().parents[1]
HOLD = (  # another process that takes the lock, says so, and holds it until killed
    "import sys, time; from pathlib import Path; from miniverl.run_lock import RunLock\n"
    "with RunLock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)\n"
)


def test_a_second_lock_on_a_held_directory_is_refused_naming_the_holder_and_the_fix(tmp_path):
    with RunLock(tmp_path):
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["started"]
        with pytest.raises(ConfigError) as refused:
            RunLock(tmp_path).__enter__()  # another open file: flock refuses it, as it would another process
    message = str(refused.value)
    assert f"is in use by another miniverl run (pid {os.getpid()}, started {record['started']})" in message
    assert f"kill {os.getpid()}" in message and "hydra.run.dir=" in message and "\n" not in message
    assert not (tmp_path / LOCK_FILE).exists()  # released: removed
    with RunLock(tmp_path):  # and free again
        pass


def test_another_process_holding_the_directory_is_named_and_its_lock_taken_over_once_it_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=f"in use by another miniverl run \\(pid {holder.pid}, started"):
            RunLock(tmp_path).__enter__()
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: no release, the file stays
        holder.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    said = []
    with RunLock(tmp_path, said.append):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"named a run that ended without releasing it (pid {holder.pid}, started" in said[0]
    assert "takes it over" in said[0]


def test_a_stale_lock_file_is_named_and_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 4194301, "started": "2026-12-07 09:00:00 UTC"}))
    said = []
    with RunLock(tmp_path, said.append):
        pass
    assert said == [
        f"[miniverl] {tmp_path / LOCK_FILE} named a run that ended without releasing it (pid 4194301, started"
        " 2026-12-07 09:00:00 UTC): no process holds it, so this run takes it over"
    ]


def test_a_refused_run_leaves_a_directory_the_lock_made_as_it_was(tmp_path):
    run_dir = tmp_path / "new" / "run"
    with RunLock(run_dir):
        assert run_dir.is_dir()
    assert not run_dir.exists()  # nothing was written: the directory is gone again
    with RunLock(run_dir):
        (run_dir / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]  # a run's files stay, the lock goes


def test_train_in_a_held_directory_is_refused_before_it_reads_or_writes_anything(tmp_path, monkeypatch):
    import miniverl.setup.prepare
    from miniverl.main import train
    from tests.test_config import load

    def unreachable(*_args, **_kwargs):
        raise AssertionError("prepare_run ran: the lock comes first")

    monkeypatch.setattr(miniverl.setup.prepare, "prepare_run", unreachable)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # the first run's first line
    with RunLock(tmp_path):
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        with pytest.raises(ConfigError, match=f"in use by another miniverl run \\(pid {os.getpid()},"):
            train(load("trainer.resume=auto"), tmp_path, {}, log=lambda *_: None)
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
