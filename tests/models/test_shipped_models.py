"""The built-in models that ship with the package (miniverl/models/shipped/): every experiment's recipe is there, the
recipe still retraces their builds, a first run copies them instead of training, and the builder's early stop."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from miniverl.models.builtin import (
    RECORDED_LOSSES,
    STORAGE_DTYPE,
    SftSpec,
    build_model,
    ensure_builtin_models,
    greedy_accuracy,
    initial_model,
    role_spec,
    sft_train,
    ship_model,
    shipped_dir,
    torch_threads,
)
from tests.conftest import TINY_ARCH, TINY_RECIPE
from tests.scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[2]
RESHIP = "rebuild them: python scripts/build_models.py --experiments --ship"
BUILT_FILES = sorted(
    [
        "build.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
)


def build_script():
    return load_script("scripts/build_models.py")


@pytest.fixture(scope="module")
def recipes():
    return build_script().experiment_recipes()


def test_every_experiments_builtin_model_ships_with_its_recipe(recipes):
    assert {r.task for r in recipes} >= {"reverse", "sort", "reverse+sort"}  # gkd, pg_k1, mopd
    for recipe, roles in recipes.items():
        for role in roles:
            record = shipped_dir(recipe, role) / "build.json"
            assert record.exists(), f"no shipped {role} for {recipe.key()}: {RESHIP}"
            assert json.loads(record.read_text())["recipe"] == asdict(recipe), RESHIP


def test_the_recipe_still_retraces_the_first_steps_of_each_shipped_build(recipes):
    """Retraining the first steps from the recipe gives the losses the build recorded: the code, the data stream and
    the initialization still produce the shipped models (a full rebuild: scripts/build_models.py --check)."""
    for recipe, roles in recipes.items():
        for role in roles:
            shipped = shipped_dir(recipe, role)
            record = json.loads((shipped / "build.json").read_text())
            tok = AutoTokenizer.from_pretrained(str(shipped))
            arch, sft = role_spec(recipe, role)
            with torch_threads(1):
                model = initial_model(tok, arch, sft.seed)
                again = sft_train(model, tok, recipe, sft, log=lambda *_: None, stop_after=RECORDED_LOSSES)
            assert again["first_losses"] == pytest.approx(record["first_losses"], rel=1e-4), f"{shipped}: {RESHIP}"


def test_a_first_run_copies_the_shipped_models_instead_of_training(tmp_path, recipes):
    recipe = next(r for r in recipes if r.task == "reverse")
    lines = []
    paths = ensure_builtin_models(tmp_path, recipe, lines.append)
    assert not [line for line in lines if "building" in line], lines
    assert sum("ships with miniverl" in line for line in lines) == 2
    for role, path in paths.items():
        assert sorted(f.name for f in path.iterdir()) == BUILT_FILES  # what a local build leaves
        cached = Qwen2ForCausalLM.from_pretrained(str(path))
        shipped = Qwen2ForCausalLM.from_pretrained(str(shipped_dir(recipe, role)), dtype=torch.float32)
        assert cached.dtype == torch.float32  # the cache holds what a local build saves
        for (name, a), (_, b) in zip(cached.state_dict().items(), shipped.state_dict().items()):
            assert torch.equal(a, b), name
        assert json.loads((path / "build.json").read_text()) == json.loads(
            (shipped_dir(recipe, role) / "build.json").read_text()
        )
    tok = AutoTokenizer.from_pretrained(str(paths["teacher"]))
    teacher = Qwen2ForCausalLM.from_pretrained(str(paths["teacher"]))
    assert greedy_accuracy(teacher, tok, recipe, n=64, seed=99) >= 0.95  # it is the competent teacher
    again = []
    ensure_builtin_models(tmp_path, recipe, again.append)
    assert again == []  # cached: nothing copied twice


def test_without_the_shipped_copy_the_model_is_built(tmp_path, recipes):
    recipe = next(r for r in recipes if r.task == "reverse")
    lines = []
    small = replace(recipe, student_sft=replace(recipe.student_sft, steps=2))  # another recipe: not shipped
    ensure_builtin_models(tmp_path, small, lines.append, roles=("student",))
    assert any("building the built-in student" in line for line in lines)


def test_the_build_stops_once_the_greedy_accuracy_reaches_its_bar(tmp_path):
    sft = SftSpec(steps=40, batch_size=8, lr=1e-2, seed=3, stop_accuracy=0.0, check_every=5)
    build_model(tmp_path / "m", TINY_RECIPE, TINY_ARCH, sft, log=lambda *_: None)
    record = json.loads((tmp_path / "m" / "build.json").read_text())
    assert record["steps_run"] == 5 and [c["step"] for c in record["checks"]] == [5]
    assert len(record["first_losses"]) == 5
    never = replace(sft, steps=12, stop_accuracy=None)
    build_model(tmp_path / "n", TINY_RECIPE, TINY_ARCH, never, log=lambda *_: None)
    record = json.loads((tmp_path / "n" / "build.json").read_text())
    assert record["steps_run"] == 12 and record["checks"] == []


def test_a_build_stores_weights_at_the_storage_precision_and_ships_them_exactly(tmp_path):
    sft = SftSpec(steps=3, batch_size=8, lr=1e-2, seed=3)
    build_model(tmp_path / "built", TINY_RECIPE, TINY_ARCH, sft, log=lambda *_: None)
    assert sorted(f.name for f in (tmp_path / "built").iterdir()) == BUILT_FILES
    ship_model(tmp_path / "built", tmp_path / "shipped")
    assert sorted(f.name for f in (tmp_path / "shipped").iterdir()) == BUILT_FILES
    built = Qwen2ForCausalLM.from_pretrained(str(tmp_path / "built"))
    for p in built.parameters():
        assert torch.equal(p, p.to(STORAGE_DTYPE).float())
    assert (tmp_path / "shipped" / "build.json").exists() and (tmp_path / "shipped" / "tokenizer.json").exists()


def test_shipping_refuses_weights_the_storage_precision_cannot_hold(tmp_path):
    build_model(tmp_path / "built", TINY_RECIPE, TINY_ARCH, SftSpec(0, 1, 1e-3, 5), log=lambda *_: None)
    model = Qwen2ForCausalLM.from_pretrained(str(tmp_path / "built"))
    with torch.no_grad():
        next(model.parameters()).add_(torch.rand_like(next(model.parameters())) * 1e-6 + 1e-7)
    model.save_pretrained(str(tmp_path / "built"))
    with pytest.raises(ValueError, match="cannot store exactly: rebuild it"):
        ship_model(tmp_path / "built", tmp_path / "shipped")
    assert not (tmp_path / "shipped").exists()


def test_the_build_script_refuses_ship_or_check_without_the_experiments(monkeypatch, capsys):
    script = build_script()
    for flag in ("--ship", "--check"):
        monkeypatch.setattr("sys.argv", ["build_models.py", flag])
        with pytest.raises(SystemExit) as e:
            script.main()
        assert e.value.code == 2 and "add --experiments" in capsys.readouterr().err
