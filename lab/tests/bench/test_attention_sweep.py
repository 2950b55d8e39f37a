"""The decode attention sweep (lab/bench/attention_sweep.py): on the CPU through Triton's interpreter (a child
process: Triton reads TRITON_INTERPRET when imported) every tile and launch setting computes the decode's own
output, and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the kernel is Triton; the package ships with the dev extras")

from lab.bench import attention_sweep

ROOT = Path(__file__).resolve().parents[3]


def test_every_setting_computes_the_decodes_own_attention_under_the_interpreter(tmp_path):
    args = ["--out", str(tmp_path), "--rows", "2", "--columns", "16,40", "--blocks", "16,32", "--warps", "4",
            "--stages", "1", "--repeat", "1", "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "lab.bench.attention_sweep", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cells = json.loads((tmp_path / "attention_sweep.json").read_text())["cells"]
    # per column count: the decode's own setting (block 64, default launch), then blocks 16 and 32
    assert [(c["columns"], c["block"]) for c in cells] == [(16, 64), (16, 16), (16, 32), (40, 64), (40, 16), (40, 32)]
    for cell in cells:
        assert cell["us"] > 0 and cell["cache_tb_per_s"] > 0
        assert cell["max_abs_diff"] < 1e-5, cell  # fp32: the same sums in another order of column blocks


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shape", "qwen9"], "--shape 'qwen9': use one of"),
        (["--blocks", "48"], "power of two >= 16"),
        (["--rows", "256,x"], "give integers"),
        (["--columns", "0"], "must be >= 1"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--device", "cpu"], "do not run on 'cpu' here"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit):
        attention_sweep.main(["--out", str(tmp_path), *args])
    assert message in capsys.readouterr().err
