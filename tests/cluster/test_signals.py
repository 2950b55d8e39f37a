"""Issue 17: stopping is the driver's job, whatever delivers the signal (a terminal's Ctrl-C or `timeout` to the
whole process group, a scheduler's SIGTERM), and a closed output pipe stops the run instead of crashing it.

The end-to-end cases (signal to the process group, `| tee` whose reader died) are in tests/test_main.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from miniverl.cluster.faults import OutputClosed, StartupInterrupted, StartupSignals, StopRequests, _GuardedStream

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_output(monkeypatch):
    monkeypatch.setattr(OutputClosed, "closed", False)


def test_a_write_to_a_pipe_whose_reader_died_stops_the_run_instead_of_raising(fresh_output):
    read_fd, write_fd = os.pipe()
    stream = _GuardedStream(os.fdopen(write_fd, "w", buffering=1))
    stream.write("step 1\n")
    os.close(read_fd)  # `| tee log`: tee died (the same Ctrl-C reached it)
    stream.write("step 2\n")  # unguarded: BrokenPipeError, the run ended with no checkpoint and no summary
    stream.flush()
    assert OutputClosed.closed
    with StopRequests() as stop:
        assert stop.requested and stop.signum == signal.SIGPIPE  # the loop checkpoints, then exits 141
    stream.close()


def test_a_pipe_without_a_reader_is_seen_before_anything_is_written(fresh_output):
    from miniverl.cluster.faults import _reader_gone

    read_fd, write_fd = os.pipe()
    assert not _reader_gone(write_fd)
    os.close(read_fd)
    assert _reader_gone(write_fd)
    os.close(write_fd)


def test_a_signal_during_start_up_raises_one_exception_with_the_exit_code():
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or Ray's handler after an earlier ray.init here
    with pytest.raises(StartupInterrupted) as info, StartupSignals():
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next statement
        pytest.fail("SIGTERM did not interrupt")
    assert info.value.exit_code == 143 and str(info.value) == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before  # restored on the way out


ACTOR = """
import os, signal, time
from miniverl.process import ProcessSettings, setup_process
setup_process(ProcessSettings("cpu", torch_threads=1, actor=True))
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.2)
import peft  # noqa: F401  (imports bitsandbytes, whose CPU backend asked every actor to `pip install kernels`)
print("alive")
"""


def test_actor_processes_ignore_stop_signals_and_print_no_bitsandbytes_note():
    """A group signal reached the actors too: on the GPU a SIGTERM during an update killed the learner."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", ACTOR], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "alive", proc.stderr[-2000:]
    assert "pip install kernels" not in proc.stderr


def test_ray_init_cannot_take_the_start_up_handlers_away():
    """ray.init installs signal handlers of its own (its core worker's C++ handler dumped a stack for a SIGTERM from
    `timeout` while the actors started); start_ray puts the run's back (cluster/launch.py kept_signal_handlers)."""
    from miniverl.cluster.launch import kept_signal_handlers

    with StartupSignals():
        ours = signal.getsignal(signal.SIGTERM)
        with kept_signal_handlers():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as ray.init replaces it
        assert signal.getsignal(signal.SIGTERM) is ours
        with pytest.raises(StartupInterrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM did not interrupt")


def test_a_signal_while_the_actors_start_still_writes_the_summary(tmp_path, student_dir, teacher_dir, monkeypatch):
    """Before tracking begins there was no summary.json at all; now it says the run was interrupted and how."""
    import json

    import miniverl.cluster.launch as launch
    from miniverl.main import train
    from tests.test_config import with_models

    def interrupted(*_args):
        raise StartupInterrupted(signal.SIGTERM)

    monkeypatch.setattr(launch, "start_ray", lambda cfg, log: False)
    monkeypatch.setattr(launch, "build_actors", interrupted)
    cfg = with_models(student_dir, teacher_dir, "resources.device=cpu", "tracking=disabled")
    with pytest.raises(StartupInterrupted):
        train(cfg, tmp_path / "run", {}, lambda *_: None)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["error"] == "SIGTERM while starting: stopped before the first step, nothing saved"
