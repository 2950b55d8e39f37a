"""`python -m miniverl.merge`: a checkpoint's policy as a model directory that computes what the adapter computed, is
recorded, loads as a teacher, and is refused in one line (before any model loads) when it cannot be made."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from miniverl import merge as merging
from miniverl.checkpoints.compat import identity_hash
from miniverl.checkpoints.files import file_digest, read_state
from miniverl.checkpoints.store import step_dir
from miniverl.config import MiniVerlConfig
from miniverl.errors import ConfigError
from miniverl.models.hub import check_model_dir
from miniverl.models.loading import load_tokenizer
from miniverl.models.lora import build_lora_model
from miniverl.models.tokenizer_match import check_same_tokenizer
from miniverl.workers.learner_checkpoint import save_learner
from tests.checkpoints.test_store import TinyOptimizer
from tests.step.test_controller import LORA

IDS = torch.tensor([[1, 5, 9, 7, 3, 4, 2, 6]])  # a few of the tiny tokenizer's 43 ids


def run_config(student: Path, quantization: str = "none") -> dict:
    """The typed config main stores in every checkpoint, for a run of the tiny student under LORA."""
    config = dataclasses.asdict(MiniVerlConfig())
    config["model"]["student"].update(path=str(student), quantization=quantization)
    config["model"]["lora"].update(rank=LORA.rank, alpha=LORA.alpha, target_modules=list(LORA.target_modules))
    return config


def write_run(run_dir: Path, student: Path, steps=(3,), quantization: str = "none"):
    """A run directory with a checkpoint per step, written by the learner's save_learner over an adapter with
    non-zero lora_B (so merging changes the logits); returns the peft model of the last step."""
    config = run_config(student, quantization)
    meta = {"config": config, "config_hash": identity_hash(config), "first_eval": {"eval/accuracy": 0.0}}
    model = build_lora_model(str(student), LORA, torch.float32, "cpu")
    for step in steps:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.3)
        save_learner(str(step_dir(run_dir, step)), model, TinyOptimizer(), step, {**meta, "step": step})
    return model


def no_model_loads(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr("miniverl.models.lora.build_lora_model", refuse)
    monkeypatch.setattr("miniverl.setup.prepare.resolve_model_paths", refuse)


def test_the_merged_model_computes_the_adapters_logits_is_recorded_and_loads_as_a_teacher(student_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    trained = write_run(run, student_dir, steps=(2, 3))
    out = merging.merge(run, tmp_path / "merged")  # a run directory: its newest checkpoint, step 3

    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want, got, plain = (m(IDS).logits for m in (trained.eval(), merged, base))  # [1, T, V]
    assert (want - plain).abs().max() > 0.1  # the adapter changes the policy, so the comparison below can fail
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    state = read_state(step_dir(run, 3))
    record = json.loads((out / "build.json").read_text())
    assert record["checkpoint"] == str(step_dir(run, 3).resolve()) and record["source"] == str(run.resolve())
    assert (record["step"], record["policy_version"], record["policy_digest"]) == (3, 3, state["policy_digest"])
    assert record["base"]["ref"] == str(student_dir) and "converted_from" not in record["base"]  # not a GGUF
    assert record["base"]["sha256"] == {"model.safetensors": file_digest(student_dir / "model.safetensors")}
    assert record["lora"] == {"rank": LORA.rank, "alpha": LORA.alpha, "target_modules": list(LORA.target_modules)}
    assert record["dtype"] == "float32" and record["merged_in"] == "float32"  # the tiny student is stored in fp32
    assert set(record["versions"]) == {"miniverl", "torch", "transformers", "peft"} and record["date"]

    # what a run checks of model.teacher.path=OUT_DIR against the same base student
    check_model_dir(out, "model.teacher.path", "-")
    student_tok = load_tokenizer(str(student_dir))
    check_same_tokenizer(student_tok, load_tokenizer(str(out)), str(student_dir), str(out), merged.config.vocab_size)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_a_checkpoint_folder_merges_in_the_dtype_asked_for_into_an_empty_out_dir(student_dir, tmp_path):
    from safetensors import safe_open

    write_run(tmp_path / "run", student_dir)
    (tmp_path / "merged").mkdir()  # an empty directory is taken, as a new one is
    out = merging.merge(step_dir(tmp_path / "run", 3), tmp_path / "merged", dtype="bfloat16")
    assert json.loads((out / "build.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118


def corrupt_digest(run: Path) -> None:
    """state.json's recorded policy no longer the adapter beside it (state.json is not among the hashed files)."""
    path = step_dir(run, 3) / "state.json"
    state = json.loads(path.read_text())
    state["policy_digest"] = "fp1-" + "0" * 64
    path.write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "does not exist; pass a run directory"),
        ("no_checkpoint", "holds no checkpoint"),
        ("out_not_empty", "exists and is not empty; refusing to overwrite it"),
        ("nf4", "(4-bit) student"),
        ("digest", "does not hash to the policy digest its state.json recorded"),
        ("dtype", "--dtype 'int8'"),
    ],
)
def test_every_refusal_is_one_line_before_any_model_loads_and_writes_nothing(
    student_dir, tmp_path, monkeypatch, case, expected
):
    run, out, dtype = tmp_path / "run", tmp_path / "merged", "stored"
    if case == "no_checkpoint":
        (run / ".hydra").mkdir(parents=True)  # a run stopped before its first checkpoint
    elif case != "missing":
        write_run(run, student_dir, quantization="nf4" if case == "nf4" else "none")
    if case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    if case == "digest":
        corrupt_digest(run)
    if case == "dtype":
        dtype = "int8"
    no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as info:
        merging.merge(run, out, dtype)
    assert expected in str(info.value) and "\n" not in str(info.value)
    if case == "out_not_empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_a_merge_that_fails_while_writing_leaves_nothing_behind(student_dir, tmp_path, monkeypatch):
    write_run(tmp_path / "run", student_dir)

    def fail(*_args, **_kwargs):
        raise ConfigError("the tokenizer probe failed")

    monkeypatch.setattr("miniverl.models.tokenizer_match.check_same_tokenizer", fail)
    with pytest.raises(ConfigError, match="probe failed"):
        merging.merge(tmp_path / "run", tmp_path / "merged")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_command_line_says_a_refusal_in_one_line_and_exits_2(tmp_path, capsys):
    assert merging.main([str(tmp_path / "nowhere"), str(tmp_path / "merged")]) == merging.ERROR_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert err.startswith("miniverl.merge: error: ") and "\n" not in err and "does not exist" in err
