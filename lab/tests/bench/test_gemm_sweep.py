"""The decode GEMM sweep (lab/bench/gemm_sweep.py) on the CPU at a tiny shape: its GEMM list, that every
variant computes the same product, and its refusals."""

from __future__ import annotations

import json

import pytest

from lab.bench import gemm_sweep
from miniverl.models.random_init import REAL_SHAPES


def test_the_gemms_are_the_fused_decode_weights_of_the_shape():
    gemms = gemm_sweep.decode_gemms(REAL_SHAPES["qwen2.5-0.5b"], 32)
    # q 896 + k/v 2 x (2 KV heads x 64) + A 32; down reads the 4,864-wide intermediate (the profile's N = 928)
    assert gemms["qkv+A"] == (1184, 896) and gemms["down+A"] == (928, 4864) and gemms["gate_up+A"] == (9760, 896)
    assert gemms["down_B"] == (896, 32) and gemms["lm_head"] == (151936, 896)


def test_a_tiny_sweep_runs_on_the_cpu_and_every_variant_computes_the_same_product(tmp_path):
    result = gemm_sweep.main(["--out", str(tmp_path), "--shape", "tiny", "--rows", "3,8", "--variants",
                              "linear,pad256,kn", "--repeat", "2"])  # fmt: skip
    written = json.loads((tmp_path / "gemm_sweep.json").read_text())
    assert written["cells"] == result["cells"] and len(result["cells"]) == 9 * 2 * 3
    for cell in result["cells"]:
        assert cell["us"] > 0 and cell["weight_tb_per_s"] > 0
        # bf16 outputs of one fp32-accumulated product: equal, or one rounding apart where the sum order differs
        assert cell["max_abs_diff"] <= 2**-6 * 4, cell


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shape", "qwen9"], "--shape 'qwen9': use one of"),
        (["--variants", "linear,magic"], "unknown magic"),
        (["--variants", "inductor", "--device", "cpu"], "leave it out on the CPU"),
        (["--rows", "64,x"], "give widths as integers"),
        (["--rank", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_name_the_flag(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        gemm_sweep.main(["--out", str(tmp_path), "--shape", "tiny", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "gemm_sweep.json").exists()


def test_an_unknown_variant_name_is_refused_where_calls_are_built():
    with pytest.raises(ValueError, match="unknown variant 'x'"):
        gemm_sweep.variant_fn("x", None)
