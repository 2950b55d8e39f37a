"""MINIVERL_PROFILE_CALL: one call of each teacher and learner under torch's profiler, where it runs; bad values
refused before Ray with the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lab.bench.learner import objective_for, ready_for_update, synthetic_batch, synthetic_scores
from miniverl.errors import ConfigError
from miniverl.models.lora import LoraSettings
from miniverl.observe.profile import CallProfile, profile_request
from miniverl.process import ProcessSettings
from miniverl.setup.prepare import check_diagnostics
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.scorer import ScorerWorker
from tests.random_models import save_random_qwen2

CPU = ProcessSettings("cpu", torch_threads=1)


def test_off_unless_asked_and_bad_values_refused_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("MINIVERL_PROFILE_CALL", raising=False)
    monkeypatch.delenv("MINIVERL_PROFILE_DIR", raising=False)
    assert profile_request() is None
    monkeypatch.setenv("MINIVERL_PROFILE_CALL", "0")
    assert profile_request() is None
    for bad in ("three", "-1", "2.5"):
        monkeypatch.setenv("MINIVERL_PROFILE_CALL", bad)
        with pytest.raises(ConfigError, match=f"MINIVERL_PROFILE_CALL='{bad}': set it to the call to profile"):
            profile_request()
        with pytest.raises(ConfigError, match="MINIVERL_PROFILE_CALL"):
            check_diagnostics(lambda line: None)  # the driver refuses it before Ray
    monkeypatch.setenv("MINIVERL_PROFILE_CALL", "3")
    with pytest.raises(ConfigError, match="needs MINIVERL_PROFILE_DIR: set it to the directory"):
        profile_request()
    monkeypatch.setenv("MINIVERL_PROFILE_DIR", str(tmp_path / "prof"))
    assert profile_request() == (3, tmp_path / "prof")
    said: list[str] = []
    check_diagnostics(said.append)
    assert said == [
        "[miniverl] MINIVERL_PROFILE_CALL=3: each learner's update 3 and each teacher's scoring call 3 run under"
        f" torch's profiler (slower); their tables go to {tmp_path / 'prof'}"
    ]


def test_the_driver_refuses_a_bad_memory_history_value_on_the_cpu_too(monkeypatch):
    monkeypatch.setenv("MINIVERL_CUDA_MEMORY_HISTORY", "yes")
    with pytest.raises(ConfigError, match="MINIVERL_CUDA_MEMORY_HISTORY='yes': set it to 1"):
        check_diagnostics(lambda line: None)


def test_only_the_asked_call_is_profiled(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVERL_PROFILE_CALL", "2")
    monkeypatch.setenv("MINIVERL_PROFILE_DIR", str(tmp_path / "made"))  # made when missing
    profile = CallProfile("thing", "cpu")
    a = torch.randn(32, 32)
    for _ in range(3):
        with profile():
            a = a @ a.T / 32
    files = list((tmp_path / "made").iterdir())
    assert [f.name for f in files] == [profile.written.name] and profile.written.name.startswith("thing-call2-pid")
    text = profile.written.read_text()
    assert "aten::mm" in text and "by self cpu time:" in text
    twin = CallProfile("thing", "cpu")  # another actor of this process with the same name: its table is kept beside
    for _ in range(2):
        with twin():
            a = a @ a.T / 32
    assert twin.written != profile.written and twin.written.name.endswith("-2.txt") and profile.written.exists()


def test_a_teacher_and_a_learner_profile_their_asked_call_and_compute_the_same(monkeypatch, tmp_path):
    model = tmp_path / "teacher-model"
    save_random_qwen2(model, hidden_size=32, intermediate_size=64, vocab_size=96)
    batch = synthetic_batch(4, 3, 5, vocab=96, seed=0)
    monkeypatch.delenv("MINIVERL_PROFILE_CALL", raising=False)
    plain = ScorerWorker(str(model), "float32", 4, CPU).score(batch, 8)
    monkeypatch.setenv("MINIVERL_PROFILE_CALL", "1")
    monkeypatch.setenv("MINIVERL_PROFILE_DIR", str(tmp_path / "prof"))
    scorer = ScorerWorker(str(model), "float32", 4, CPU)
    profiled = scorer.score(batch, 8)
    assert scorer.profile.written.name.startswith("scorer-teacher-model-call1-pid")
    for field in dataclasses.fields(plain):
        a, b = getattr(plain, field.name), getattr(profiled, field.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name

    learner = LearnerWorker(
        str(model),
        LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0),
        "float32",
        objective_for("gkd", topk=8),
        lr=1e-5,
        weight_decay=0.0,
        max_grad_norm=1.0,
        process=CPU,
        micro_batch_size=4,
    )
    metrics = learner.update(ready_for_update(learner, batch), synthetic_scores(batch, 96, 8, seed=0), None)
    assert learner.version == 1 and torch.isfinite(torch.tensor(metrics["loss"]))  # applied, not refused
    assert learner.profile.written.name.startswith("learner0-call1-pid")
    assert "aten::" in learner.profile.written.read_text()
