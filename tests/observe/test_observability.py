"""What the operator sees: dashboard gauges, PNG plots, metrics kept across resume."""

from __future__ import annotations

import json
import sys
from typing import ClassVar

import pytest

from miniverl.observe.plots import MISSING_MATPLOTLIB, write_plots
from miniverl.observe.tracking import REPLACED_METRICS, STEP_GAUGES, RunGauges, trim_metrics
from tests.ray_local import init_local_ray

STEP = {
    "reverse_kl": 0.5,
    "accuracy": 0.25,
    "rollout_tokens_per_s": 900.0,
    "time/refresh": 0.1,
    "time/generate": 0.4,
    "time/score": 0.2,
    "time/update": 0.3,
    "time/step": 1.0,
}


class FakeGauge:
    made: ClassVar[dict[str, FakeGauge]] = {}

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.values = name, tuple(tag_keys), {}
        FakeGauge.made[name] = self

    def set(self, value, tags=None):
        assert set(tags or {}) == set(self.tag_keys)
        self.values[tuple(sorted((tags or {}).items()))] = value


def test_dashboard_gauges_carry_step_phases_throughput_kl_accuracy_and_memory():
    gauges = RunGauges(FakeGauge)
    gauges.record(7, {**STEP, "eval/accuracy": 0.75})
    made = FakeGauge.made
    assert made["miniverl_step"].values[()] == 7.0
    assert made["miniverl_step_seconds"].values[()] == 1.0
    assert made["miniverl_rollout_tokens_per_s"].values[()] == 900.0
    assert made["miniverl_reverse_kl"].values[()] == 0.5 and made["miniverl_accuracy"].values[()] == 0.25
    assert made["miniverl_eval_accuracy"].values[()] == 0.75
    assert made["miniverl_eval_reverse_kl"].values == {}  # no eval this step: the gauge keeps its last value
    phases = made["miniverl_phase_seconds"].values
    assert phases == {(("phase", p),): STEP[f"time/{p}"] for p in ("refresh", "generate", "score", "update")}
    gauges.record_memory({"rollout": {"peak_allocated_gib": 3.5}, "scorer": {}})
    assert made["miniverl_gpu_memory_gib"].values == {(("actor", "rollout"),): 3.5}
    assert len(STEP_GAUGES) == 7


def test_ray_gauges_record_in_a_ray_session():
    ray = pytest.importorskip("ray")
    init_local_ray(num_cpus=1)
    try:
        RunGauges().record(1, STEP)  # real ray.util.metrics gauges accept every name, tag and value
    finally:
        ray.shutdown()


def write_metrics(path, steps=(0, 1, 2, 3)):
    lines = []
    for s in steps:
        record = {"step": s, **STEP, "reverse_kl": 1.0 / (s + 1)} if s else {"step": 0}
        if s in (0, steps[-1]):
            record.update({"eval/reverse_kl": 2.0 - s * 0.1, "eval/accuracy": 0.1 * s})
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")


def test_plots_are_pngs_of_kl_accuracy_and_step_time(tmp_path):
    pytest.importorskip("matplotlib")
    write_metrics(tmp_path / "metrics.jsonl")
    written = write_plots(tmp_path / "metrics.jsonl", tmp_path, log=lambda *_: None)
    assert [p.name for p in written] == ["reverse_kl.png", "accuracy.png", "step_time.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_say_how_to_get_them(tmp_path, monkeypatch):
    write_metrics(tmp_path / "metrics.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    said = []
    assert write_plots(tmp_path / "metrics.jsonl", tmp_path, said.append) == []
    assert said == [MISSING_MATPLOTLIB] and "pip install" in said[0]
    assert not list(tmp_path.glob("*.png"))


def test_trim_metrics_keeps_steps_up_to_the_checkpoint_and_loses_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, steps=(0, 1, 2, 3, 4))
    original = path.read_text().splitlines()
    kept = trim_metrics(path, 2)
    assert [r["step"] for r in kept] == [0, 1, 2]
    assert path.read_text().splitlines() == original[:3]
    assert (tmp_path / REPLACED_METRICS).read_text().splitlines() == original[3:]
    assert trim_metrics(tmp_path / "absent.jsonl", 2) == []
    samples = tmp_path / "samples.jsonl"  # evaluation rows of redone steps are set aside the same way
    write_metrics(samples, steps=(0, 2, 4))
    trim_metrics(samples, 2)
    assert [json.loads(x)["step"] for x in samples.read_text().splitlines()] == [0, 2]
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.replaced.jsonl").read_text().splitlines()] == [4]


def test_the_final_summary_lists_only_what_the_run_wrote(tmp_path, capsys):
    """Issue 17: the last line listed wandb/ (and plots) with tracking disabled."""
    from miniverl.main import print_summary

    (tmp_path / ".hydra").mkdir()
    for name in (".hydra/config.yaml", "metrics.jsonl", "summary.json"):
        (tmp_path / name).write_text("{}")
    summary = {"steps": 1, "objective": "gkd", "device": "cpu", "wall_seconds": 1.0, "memory": {}}
    summary |= {"start_reverse_kl": 1.0, "end_reverse_kl": 0.5, "start_accuracy": 0.1, "end_accuracy": 0.2}
    print_summary(summary, tmp_path)
    assert f"run directory: {tmp_path} (config, metrics.jsonl, summary.json)\n" in capsys.readouterr().out


def test_matplotlib_is_a_dependency_so_plots_work_after_pip_install():
    """Issue 17: `pip install -e .` brought no matplotlib, so a first run drew no plots (tracking.plots is on)."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("matplotlib") for d in project["dependencies"])


def test_building_a_model_reports_progress_every_few_seconds(monkeypatch, tmp_path):
    """Issue 17: on a busy 2-core box the first run printed one line every ~5 minutes and looked hung."""
    import itertools

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from miniverl.models import builtin
    from miniverl.models.tokenizer import save_char_tokenizer

    clock = itertools.count(0, 6)  # every call 6 s later: each step takes longer than BUILD_REPORT_SECONDS
    monkeypatch.setattr(builtin.time, "monotonic", lambda: float(next(clock)))
    save_char_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    lines = []
    recipe = builtin.BuiltinRecipe("reverse", 2, 3)
    builtin.sft_train(Qwen2ForCausalLM(config), tok, recipe, builtin.SftSpec(20, 4, 1e-3, 0), lines.append)
    assert len(lines) == 20, lines  # one per step here; before: one per 20% of the steps
    assert lines[-1].startswith("[miniverl]   sft step 20/20") and "s left)" in lines[-1]
