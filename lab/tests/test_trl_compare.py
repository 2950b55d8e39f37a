"""lab/measurements/trl_gkd_compare.py: import-safe, refuses bad arguments before loading anything, and (where
TRL is installed, as in the device bundle) runs TRL's GKDTrainer on tiny models on the CPU."""

from __future__ import annotations

import json
import sys

import pytest

from tests.scripts_loader import load_script as load_path


def load_script():
    return load_path("lab/measurements/trl_gkd_compare.py")


def test_importing_the_script_imports_no_trl():
    before = "trl" in sys.modules
    load_script()
    assert ("trl" in sys.modules) == before


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--micro-batch", "3"], "must divide --prompts x --samples = 8 rows"),
        (["--steps", "0"], "--steps=0: must be >= 1"),
        (["--beta", "1.5"], "--beta=1.5: must be in"),
    ],
)
def test_bad_arguments_name_the_fix(student_dir, teacher_dir, tmp_path, capsys, extra, message):
    args = ["--student", str(student_dir), "--teacher", str(teacher_dir), "--out", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit):
        load_script().parse_args([*args, "--prompts", "2", "--samples", "4", "--cpu", *extra])
    assert message in capsys.readouterr().err


def test_missing_model_and_missing_gpu_are_refused(student_dir, tmp_path, capsys):
    import torch

    script = load_script()
    with pytest.raises(SystemExit):
        script.parse_args(["--student", str(student_dir), "--teacher", str(tmp_path), "--out", "o.json", "--cpu"])
    assert "not a model directory" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            script.parse_args(["--student", str(student_dir), "--teacher", str(student_dir), "--out", "o.json"])
        assert "pass --cpu for a smoke test" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_smoke_with_tiny_models(student_dir, teacher_dir, tmp_path):
    pytest.importorskip("trl", reason="TRL is in the device bundle, not a miniVERL dependency")
    out = tmp_path / "trl.json"
    load_script().main(
        [
            *("--student", str(student_dir), "--teacher", str(teacher_dir), "--out", str(out)),
            *("--prompts", "2", "--samples", "2", "--max-new-tokens", "4", "--micro-batch", "2"),
            *("--steps", "2", "--lora-rank", "4", "--cpu"),
        ]
    )
    result = json.loads(out.read_text())
    assert result["rows_per_step"] == 4 and len(result["step_seconds"]) == 2
    assert result["median_step_seconds"] > 0 and result["device"] == "cpu"
