"""NF4 settings: refused before Ray where they cannot work (CPU, no bitsandbytes, a rollout side that would
serve another base), with what to change or install; the bitsandbytes config they load with."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miniverl.config import validate
from miniverl.errors import ConfigError
from miniverl.models.loading import load_causal_lm, nf4_config, require_quantization
from miniverl.setup.prepare import prepare
from tests.test_config import load, with_models


def test_nf4_config_is_double_quantized_nf4_with_bf16_compute():
    q = nf4_config()
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16


def test_nf4_on_the_cpu_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"model.student.quantization=nf4 .* needs a CUDA GPU.*set model.student"):
        require_quantization("nf4", "cpu", "model.student.quantization")
    require_quantization("none", "cpu", "model.student.quantization")  # the default works everywhere


def test_nf4_without_bitsandbytes_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    with pytest.raises(ConfigError, match=r"needs bitsandbytes, which is not installed; pip install"):
        require_quantization("nf4", "cuda", "model.teacher.quantization")


def test_unknown_quantization_is_refused():
    with pytest.raises(ConfigError, match=r"model.teacher.quantization='int8': use one of none, nf4"):
        validate(load("model.teacher.quantization=int8"))
    with pytest.raises(ConfigError, match=r"quantization='fp8': use one of none, nf4"):
        require_quantization("fp8", "cuda", "quantization")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout=hf_cached"], r"rollout=hf_cached: hf_cached decodes from plain .bf16. copies.*not yet"),
        (
            ["rollout=vllm", "rollout.vllm.refresh=merged"],
            r"refresh=merged: merging .* use rollout.vllm.refresh=adapter",
        ),
    ],
)
def test_nf4_student_with_a_rollout_that_serves_another_base_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load("model.student.quantization=nf4", *overrides))
    fp32 = "model.student.dtype=float32"  # vllm refresh=merged is refused in bf16 (an inexact merge) too
    validate(load(fp32, *overrides))  # the same rollout with an unquantized student is fine
    validate(load(fp32, "model.teacher.quantization=nf4", *overrides))  # a 4-bit teacher serves nothing


def test_prepare_refuses_nf4_on_the_cpu_before_loading_models(tmp_path):
    """The paths do not exist: the device check comes first, before any model is resolved."""
    cfg = with_models(tmp_path / "nowhere", tmp_path / "nowhere", "model.teacher.quantization=nf4")
    with pytest.raises(ConfigError, match=r"model.teacher.quantization=nf4 .* computes on the CPU"):
        prepare(cfg, log=lambda *_: None)


def test_loading_a_4bit_model_on_the_cpu_is_refused_before_reading_weights(tmp_path):
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        load_causal_lm(str(tmp_path / "nowhere"), torch.bfloat16, "cpu", "nf4")


def test_prepare_refuses_a_full_vocabulary_support_over_the_budget(student_dir, teacher_dir):
    """At the tiny vocabulary (43 logits) a budget of 161 KiB plays the part of 4 GiB at 152k."""
    cfg = with_models(student_dir, teacher_dir, "objective.teacher_topk=0", "trainer.vocab_memory_budget_gib=1.5e-4")
    with pytest.raises(
        ConfigError,
        match=r"teacher's support of one step would take 0.2 MiB: 64 rows x 16 tokens x 43 x 4 B \(full vocabulary\)",
    ):
        prepare(cfg, log=lambda *_: None)
    fits = with_models(
        student_dir,
        teacher_dir,
        "objective.teacher_topk=4",
        "trainer.vocab_memory_budget_gib=1.5e-4",
        "trainer.logprob_chunk_tokens=64",
    )
    # 64 rows x 16 tokens x (4 x 12 + 8) B = 56 KiB of top-4 support; one LM-head chunk of the learner: 64 tokens
    # x 43 x 4 B x 6 buffers = 65 KiB, both under the budget (a whole 16 x 16-token micro-batch would be 258 KiB).
    prepare(fits, log=lambda *_: None)


def test_the_default_sampler_is_the_one_that_serves_the_students_base():
    """rollout.backend=auto (the default): hf_cached, whose refusal of an NF4 student would otherwise greet every QLoRA
    user who names no rollout; for an NF4 student hf_reference, which serves the 4-bit base as loaded."""
    from miniverl.setup.prepare import choose_rollout_backend

    for quantization, want in (("none", "hf_cached"), ("nf4", "hf_reference")):
        cfg = load(f"model.student.quantization={quantization}")
        assert cfg.rollout.backend == "auto"
        validate(cfg)  # auto is never refused for the student's base: it resolves to a sampler that serves it
        said = []
        assert choose_rollout_backend(cfg, said.append) == {"rollout.backend": want}
        assert cfg.rollout.backend == want and len(said) == 1
        assert said[0].startswith(f"[miniverl] rollout.backend={want} (chosen: ")
        validate(cfg)  # the chosen backend passes the checks a named one meets
    named = load("rollout=vllm")
    assert choose_rollout_backend(named, print) == {} and named.rollout.backend == "vllm"  # a named one is kept
