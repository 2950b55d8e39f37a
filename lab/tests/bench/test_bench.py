"""The benchmark harness: preregistered files compose, rules fire, every cell is reported. Speed is not
under test here (CPU, tiny shape); lab/results/ holds the GPU results."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lab.bench import invalidation
from lab.bench.config import AdapterSpec, InvalidationRules
from lab.bench.report import speedup, targets
from lab.bench.runner import CellResult
from lab.bench.workload import cell_requests, expand_cells, make_adapter
from miniverl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
RULES = InvalidationRules(
    logprob_gap_mean_max=0.05, logprob_gap_outlier=0.6931, logprob_gap_outlier_frac_max=0.001, spread_max=0.10
)


def compose(name: str, *overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from lab.bench.config import MAIN_NAME, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "lab" / "conf"), version_base=None):
        return OmegaConf.to_object(hydra_compose(config_name=MAIN_NAME, overrides=[f"+bench={name}", *overrides]).bench)


def test_the_preregistered_runtime_bench_fixes_24_cells_on_the_real_shape():
    cfg = compose("rollout-runtime-v3")
    cells = expand_cells(cfg)
    assert len(cells) == 24
    assert {c.label for c in cells} == {"hf_reference", "hf_cached", "vllm"}
    assert {(c.length, c.prompts, c.samples) for c in cells} == {(t, g, 4) for t in (256, 512) for g in (4, 8, 16, 32)}
    m = cfg.model
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads) == (896, 24, 14, 2)
    assert (m.intermediate_size, m.vocab_size, m.tie_word_embeddings) == (4864, 151936, True)
    assert (cfg.dtype, cfg.baseline, cfg.oracle, cfg.targets) == (
        "bfloat16",
        "hf_reference",
        "hf_reference",
        {"hf_cached": 3.0},
    )


def test_a_bench_file_with_an_unknown_key_is_refused(tmp_path):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose("rollout-smoke", "bench.not_a_field=1")


def test_workload_forces_the_length_and_gives_one_seed_per_row():
    cfg = compose("rollout-runtime-v3")
    cell = expand_cells(cfg)[3]
    prompts, params, seeds = cell_requests(cfg, cell)
    assert len(prompts) == cell.prompts and len(seeds) == cell.rows == len(set(seeds))
    assert all(16 <= len(p) <= 64 for p in prompts) and len({len(p) for p in prompts}) > 1
    assert params.stop_token_ids == () and params.max_new_tokens == cell.length
    assert cell_requests(cfg, cell)[0] == prompts  # every backend gets the same prompts


def test_adapter_is_non_zero_and_the_same_for_every_backend():
    spec = AdapterSpec(rank=2, alpha=4.0, target_modules=["q_proj"], init_std=0.02, seed=1)
    template = {"b.lora_B.weight": torch.zeros(3, 2), "a.lora_A.weight": torch.zeros(2, 3, dtype=torch.bfloat16)}
    one, two = make_adapter(template, spec), make_adapter(dict(reversed(template.items())), spec)
    assert all(torch.equal(one[k], two[k]) and one[k].abs().sum() > 0 for k in template)
    assert one["a.lora_A.weight"].dtype == torch.bfloat16


def test_rules():
    assert invalidation.short_rows([5, 5, 5], 5) == []
    assert "2 of 3 rows short (shortest 3 of 5)" in invalidation.short_rows([5, 4, 3], 5)[0]
    assert invalidation.spread([100.0], 0.1) == (None, [])
    s, reasons = invalidation.spread([100.0, 105.0, 120.0], 0.1)
    assert s == pytest.approx(20 / 105) and "spread across repeats" in reasons[0]
    assert invalidation.spread([100.0, 105.0], 0.1)[1] == []
    stats, reasons = invalidation.logprob_gap(torch.full((1000,), 0.01), RULES)
    assert reasons == [] and stats["gap_mean"] == pytest.approx(0.01)
    gaps = torch.full((1000,), 0.01)
    gaps[:2] = 1.0  # 0.2% of tokens with an importance ratio outside [0.5, 2]
    assert "0.20% of tokens" in invalidation.logprob_gap(gaps, RULES)[1][0]
    assert "mean gap" in invalidation.logprob_gap(torch.full((10,), 0.2), RULES)[1][0]
    assert "non-finite" in invalidation.logprob_gap(torch.tensor([0.0, float("nan")]), RULES)[1][0]


def _cell(label: str, status: str, tps: list[float], reasons=()) -> CellResult:
    return CellResult(label, label, 256, 4, 4, status=status, reasons=list(reasons), tokens_per_s=tps)


def test_speedups_bounds_and_target_verdicts():
    cfg = compose("rollout-runtime-v3")
    fast, ref = _cell("hf_cached", "valid", [400.0, 420.0, 410.0]), _cell("hf_reference", "valid", [100.0])
    assert speedup(fast, [fast, ref], cfg) == (pytest.approx(4.1), "")
    capped = _cell("hf_reference", "invalid", [], ["time cap: stopped after 40s"])
    bound, note = speedup(fast, [fast, capped], cfg)
    assert bound == pytest.approx(410.0 * 40 / (16 * 256)) and "lower bound" in note
    assert speedup(fast, [fast, _cell("hf_reference", "invalid", [], ["out of memory"])], cfg) == (
        None,
        "baseline invalid",
    )
    cells = [
        {
            "label": "hf_cached",
            "length": 256,
            "prompts": p,
            "samples": 4,
            "status": "valid",
            "speedup": s,
            "speedup_note": n,
        }
        for p, s, n in [(4, 3.5, ""), (8, 2.0, ""), (16, 1.5, "lower bound"), (32, None, "")]
    ]
    assert [t["verdict"] for t in targets(cfg, cells)] == ["met", "missed", "not shown", "not evaluable"]


def test_missing_bench_choice_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "lab.bench"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "+bench=rollout-runtime-v3" in out.stderr


def test_a_malformed_override_is_refused_in_one_line_with_its_fix():
    out = subprocess.run(
        [sys.executable, "-m", "lab.bench", "+bench=rollout-smoke", "nonsense"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("lab.bench: error: cannot read the override 'nonsense'") and "Fix:" in out.stderr


def test_smoke_bench_end_to_end_reports_every_cell(tmp_path):
    """The CPU smoke config through the real command. The oracle's own time cap is set to 0 so one cell is
    invalid for a known reason; vllm needs a GPU, so on the CPU its cell is not run."""
    cmd = [
        sys.executable,
        "-m",
        "lab.bench",
        "+bench=rollout-smoke",
        f"bench.output_dir={tmp_path}",
        "bench.backends.hf_reference.time_cap_s=0",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads((tmp_path / "rollout-smoke.json").read_text())
    cells = {c["label"]: c for c in doc["cells"]}
    assert set(cells) == {"hf_reference", "hf_cached", "vllm"}
    assert cells["hf_reference"]["status"] == "invalid" and cells["hf_reference"]["reasons"][0].startswith("time cap")
    assert cells["vllm"]["status"] == "not_run" and "needs a CUDA GPU" in cells["vllm"]["reasons"][0]
    fast = cells["hf_cached"]
    assert fast["status"] == "valid", fast["reasons"]
    assert len(fast["tokens_per_s"]) == 2 and fast["median_tokens_per_s"] > 0
    assert fast["oracle"]["gap_mean"] <= 1e-4  # fp32: the judge and the backend agree
    assert "lower bound" in fast["speedup_note"]
    assert doc["command"].startswith("python -m lab.bench +bench=rollout-smoke")
    assert doc["versions"]["torch"] and doc["date_utc"] and doc["machine"]["cpu_count"]
    md = (tmp_path / "rollout-smoke.md").read_text()
    assert "| hf_reference | 12 | 2 x 2 | invalid: time cap" in md
    assert "| vllm | 12 | 2 x 2 | not_run: rollout=vllm needs a CUDA GPU" in md
    assert "Command: `python -m lab.bench +bench=rollout-smoke" in md


@pytest.mark.parametrize(
    "name", ["rollout-runtime-v3", "rollout-rl-sizes-vllm", "rollout-rl-sizes-vllm-judged", "rollout-smoke"]
)
def test_every_vllm_plan_of_a_committed_bench_builds_its_engine_settings(name):
    """A bench's vllm plans are sized at construction (no GPU needed to check they are complete)."""
    from omegaconf import OmegaConf

    from lab.bench.config import BackendPlan
    from lab.bench.runner import constructor_options
    from miniverl.rollout.vllm_settings import VllmSettings

    cfg = OmegaConf.load(Path(__file__).resolve().parents[3] / "lab" / "conf" / "bench" / f"{name}.yaml")
    plans = [BackendPlan(**p) for p in cfg.backends.values() if p.backend in ("vllm", "raw_vllm")]
    assert plans
    for plan in plans:
        options, attributes = constructor_options(cfg, plan)
        assert attributes == {}
        if plan.backend == "vllm":  # constructor_options checked them as validate checks rollout.vllm
            assert isinstance(options["settings"], VllmSettings)
            assert options["settings"].max_num_seqs == max(g * n for g, n in cfg.shapes)
            typo = dataclasses.replace(plan, attributes={**plan.attributes, "refresh": "copy"})
            with pytest.raises(ConfigError, match="rollout.vllm.refresh='copy': use one of adapter, merged"):
                constructor_options(cfg, typo)


def test_sglang_cells_are_not_run_on_the_cpu_and_say_why():
    """The bench runs rollout=sglang only where its engine can run: on the CPU its cells are not run, with the
    product's reason, and nothing is constructed."""
    from lab.bench.config import BackendPlan
    from lab.bench.runner import CellResult, run_backend

    cells = [CellResult("sglang", "sglang", 16, 2, 2)]
    said = []
    ctx = SimpleNamespace(device="cpu")  # run_backend must stop before it builds anything from it
    run_backend(ctx, BackendPlan("sglang", 1, 0, None, 60.0), cells, said.append)
    assert cells[0].status == "not_run" and "rollout=sglang needs a CUDA GPU" in cells[0].reasons[0]
    assert said == [f"[bench] sglang: not run ({cells[0].reasons[0]})"]


def test_an_sglang_plan_is_sized_for_the_bench_and_its_attributes_checked_as_rollout_sglang():
    """The engine is sized for the widest cell and the longest row; a plan's attributes are rollout.sglang keys
    (plus gpu_share), refused by name when they are not or hold a bad value."""
    from omegaconf import OmegaConf

    from lab.bench.config import BackendPlan
    from lab.bench.runner import constructor_options
    from miniverl.rollout.sglang import SglangSettings

    cfg = OmegaConf.load(Path(__file__).resolve().parents[3] / "lab" / "conf" / "bench" / "rollout-smoke.yaml")
    plan = BackendPlan("sglang", 1, 0, None, 60.0, attributes={"mem_fraction_static": 0.3})
    options, attributes = constructor_options(cfg, plan)
    assert attributes == {}
    assert options["settings"] == SglangSettings("triton", 0.3, 2048, False, 4, 9 + 12, 0.5, None)
    for bad, message in [
        ({"attention_backend": "fa2"}, "rollout.sglang.attention_backend='fa2': use one of triton, flashinfer, fa3"),
        ({"mem_fraction": 0.3}, "['mem_fraction'] are not rollout.sglang keys"),
        ({"gpu_share": 0}, "gpu_share=0: a fraction of the GPU in (0, 1]"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            constructor_options(cfg, dataclasses.replace(plan, attributes=bad))
