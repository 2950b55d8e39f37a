"""lab/measurements/sdpa_shapes.py: its CPU smoke run writes both variants; without a GPU it refuses, naming the
fix; bad counts are refused before anything runs."""

from __future__ import annotations

import json

import pytest

from tests.scripts_loader import load_script


def _module():
    return load_script("lab/measurements/sdpa_shapes.py")


def test_the_cpu_smoke_run_times_first_and_repeated_shapes_for_both_variants(tmp_path):
    record = _module().main(["--out", str(tmp_path / "s.json"), "--device", "cpu", "--shapes", "3", "--repeats", "2"])
    assert json.loads((tmp_path / "s.json").read_text()) == record
    assert [v["cudnn_allowed"] for v in record["variants"]] == [True, False]
    for variant in record["variants"]:
        assert len(variant["first_ms"]) == 3 and len(variant["repeat_ms"]) == 6 and variant["first_ms_median"] > 0
    assert "flash" in record["priority_order"]


def test_without_a_gpu_it_refuses_naming_the_fix(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device here; run it on the GPU"):
        _module().main(["--out", str(tmp_path / "s.json")])
    assert not (tmp_path / "s.json").exists()


def test_bad_counts_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _module().main(["--out", str(tmp_path / "s.json"), "--shapes", "0"])
    assert e.value.code == 2 and "--shapes=0" in capsys.readouterr().err
