"""The examples stay runnable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
