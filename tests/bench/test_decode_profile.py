"""The decode profile (miniverl/bench/decode_profile.py) on the CPU at a tiny shape: the cells, the lengths its stop
tokens give, and the files it writes (the GPU-only parts, the kernel trace and graph replays, are empty here)."""

from __future__ import annotations

import argparse
import json
import math

from miniverl.bench import decode_profile


def test_the_stop_set_gives_the_asked_median():
    assert decode_profile.stop_set(0, 1000, 7) == ()
    stops = decode_profile.stop_set(150, 151936, 7)
    assert len(stops) == round(math.log(2) * 151936 / 150) == len(set(stops))
    assert stops == decode_profile.stop_set(150, 151936, 7)  # seeded


def test_a_tiny_profile_runs_on_the_cpu_and_writes_its_cells(tmp_path):
    args = argparse.Namespace(
        out=str(tmp_path), backend="hf_cached", shape="tiny", cells="4x2x24,2x1x8", prompt_len="3:9",
        stop_median=6, profile_steps=8, repeats=1,
    )  # fmt: skip
    result = decode_profile.run(args)
    written = json.loads((tmp_path / "decode_profile.json").read_text())
    assert [c["cell"] for c in written["cells"]] == ["4x2x24", "2x1x8"] == [c["cell"] for c in result["cells"]]
    first = written["cells"][0]
    lengths = first["generate"]["lengths"]
    assert 1 <= lengths["min"] <= lengths["median"] <= lengths["max"] <= 24
    assert lengths["mean"] < 24  # the stop tokens ended rows early
    assert first["generate"]["tokens"] == round(lengths["mean"] * 8)
    assert first["trace"]["steps"] == 8 and first["replay_ms"] == {}  # no CUDA graphs on the CPU
