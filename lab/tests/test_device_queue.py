"""lab/device_queue.sh: the device session's GPU work as one queue that outlasts a device call. Run here with
plain shell commands in place of GPU cells (bash only: no GPU, no Ray)."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "lab" / "device_queue.sh"


def run(args: list[str], cwd: Path, root: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "QUEUE_ROOT": str(root), "OUT": str(out), "QUEUE_POLL_S": "0.2"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def project(tmp_path: Path) -> Path:
    tree = tmp_path / "project"
    (tree / "miniverl").mkdir(parents=True)
    (tree / "miniverl" / "marker.txt").write_text("v1")
    return tree


def test_a_queue_runs_every_command_in_order_from_its_own_copy_and_is_collected(tmp_path):
    tree, root, out = project(tmp_path), tmp_path / "q", tmp_path / "out"
    out.mkdir()
    queue, more = tree / "queue.txt", tree / "more.txt"
    queue.write_text("# a comment\n\necho first\nfalse")  # no final newline: not joined to the next file's line
    more.write_text('cat miniverl/marker.txt; echo " out=$OUT"')
    started = run(["start", str(queue), str(more)], tree, root, out)
    assert started.returncode == 0 and "3 commands" in started.stdout
    (tree / "miniverl" / "marker.txt").write_text("v2")  # a later device call re-copies the tree: not seen
    collected = run(["collect", "60"], tree, root, out)
    assert collected.returncode == 0 and "queue done" in collected.stdout
    log = (root / "res" / "queue.log").read_text()
    runs = [line for line in log.splitlines() if line.startswith("== run: ") or line.startswith("== rc ")]
    assert [r.split(" (")[0] for r in runs] == [
        "== run: echo first",
        "== rc 0",
        "== run: false",
        "== rc 1",  # a failing command is logged and the queue goes on
        '== run: cat miniverl/marker.txt; echo " out=$OUT"',
        "== rc 0",
    ]
    assert f"v1 out={root / 'res'}" in log and log.rstrip().splitlines()[-1].startswith("== ALL_DONE")
    with tarfile.open(out / "res.tgz") as packed:
        assert "res/queue.log" in packed.getnames()


def test_bad_calls_say_what_to_do_and_start_nothing(tmp_path):
    tree, root, out = project(tmp_path), tmp_path / "q", tmp_path / "out"
    out.mkdir()
    assert run(["start"], tree, root, out).returncode == 2
    missing = run(["start", str(tree / "nope.txt")], tree, root, out)
    assert missing.returncode == 2 and "no queue file" in missing.stderr and not root.exists()
    early = run(["collect", "5"], tree, root, out)
    assert early.returncode == 2 and "start one first" in early.stderr
    outside = run(["start", str(tree / "nope.txt")], tmp_path, root, out)
    assert outside.returncode == 2
    (tree / "q.txt").write_text("sleep 10\n")
    assert run(["start", str(tree / "q.txt")], tree, root, out).returncode == 0
    again = run(["start", str(tree / "q.txt")], tree, root, out)  # the first is still running
    assert again.returncode == 2 and "still running" in again.stderr
    usage = run(["stop"], tree, root, out)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_a_queue_with_a_line_that_would_fail_for_its_form_is_refused_before_anything_runs(tmp_path):
    tree, root, out = project(tmp_path), tmp_path / "q", tmp_path / "out"
    out.mkdir()
    cases = {
        "PYTHONPATH=. python3 -m pytest tests": "line 2 sets PYTHONPATH without the staged site's",
        "A=1 PYTHONPATH=.:x bash run.sh": "line 2 sets PYTHONPATH without the staged site's",
        "echo 'unclosed": "line 2 is not a shell command bash can read",
    }
    for line, message in cases.items():
        queue = tree / "bad.txt"
        queue.write_text(f"echo fine\n{line}\n")
        refused = run(["start", str(queue)], tree, root, out)
        assert refused.returncode == 2 and message in refused.stderr, (line, refused.stderr)
        assert not root.exists()  # nothing copied, nothing started
    kept = tree / "good.txt"  # the staged site kept, in either spelling, or no PYTHONPATH at all
    kept.write_text(
        "PYTHONPATH=.:miniverl/x:$PYTHONPATH python3 -c pass\nPYTHONPATH=.:${PYTHONPATH} true\necho PYTHONPATH\n"
    )
    checked = run(["check", str(kept)], tmp_path, root, out)  # anywhere, before the device call: nothing runs
    assert checked.returncode == 0 and checked.stdout.startswith("ok:") and not root.exists()
    bad = run(["check", str(tree / "bad.txt")], tmp_path, root, out)
    assert bad.returncode == 2 and "is not a shell command" in bad.stderr
    started = run(["start", str(kept)], tree, root, out)
    assert started.returncode == 0 and "3 commands" in started.stdout, started.stderr
    assert "queue done" in run(["collect", "60"], tree, root, out).stdout
