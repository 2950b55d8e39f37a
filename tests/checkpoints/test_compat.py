"""Which config changes a checkpoint survives, and the run-directory rules of trainer.resume."""

from __future__ import annotations

import dataclasses
import json

import pytest

from miniverl.checkpoints.compat import check_resumable, command_line_keys, identity_hash
from miniverl.checkpoints.resume_config import resumed_config
from miniverl.checkpoints.store import step_dir
from miniverl.config import to_config
from miniverl.errors import ConfigError
from miniverl.setup.preflight import resolve_resume
from tests.test_config import load


def as_dict(*overrides: str) -> dict:
    return dataclasses.asdict(load(*overrides))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.lora.rank=8", "model.lora.rank: 32 -> 8"),
        ("model.lora.target_modules=[q_proj]", "model.lora.target_modules"),
    ],
)
def test_another_lora_shape_is_refused_naming_the_key_even_with_the_opt_in(override, named):
    for allow in ("false", "true"):
        with pytest.raises(ConfigError, match="another LoRA shape") as info:
            check_resumable(as_dict(), as_dict(override, f"trainer.resume_allow_changes={allow}"), "ckpt")
        assert named in str(info.value)
    assert identity_hash(as_dict()) != identity_hash(as_dict(override))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.student.path=/elsewhere", "model.student.path"),
        ("objective=pg_k1", "objective.name: 'gkd' -> 'pg_k1'"),
        ("objective.beta=1.0", "objective.beta"),
        ("data.train_files=[a.jsonl]", "data.train_files: [] -> ['a.jsonl']"),
        ("data.chat_template=false", "data.chat_template: True -> False"),
        ("rollout.temperature=0.7", "rollout.temperature: 1.0 -> 0.7"),
        ("reward.name=gsm8k", "reward.name"),
    ],
)
def test_changed_model_objective_data_or_sampling_needs_the_opt_in(override, named):
    with pytest.raises(ConfigError, match="another model, objective, data, reward or sampling") as info:
        check_resumable(as_dict(), as_dict(override), "ckpt")
    assert named in str(info.value) and "trainer.resume_allow_changes=true" in str(info.value)
    notes = check_resumable(as_dict(), as_dict(override, "trainer.resume_allow_changes=true"), "ckpt")
    assert any(named in n and "no longer matches an uninterrupted run" in n for n in notes), notes


def test_harmless_and_other_changes_are_allowed_and_said():
    saved = as_dict()
    assert check_resumable(saved, as_dict(), "ckpt") == []
    (note,) = check_resumable(saved, as_dict("trainer.total_steps=800", "tracking=disabled"), "ckpt")
    assert "harmless" in note and "trainer.total_steps: 400 -> 800" in note and "tracking.wandb_mode" in note
    (note,) = check_resumable(saved, as_dict("trainer.probe_every=1"), "ckpt")
    assert "harmless" in note and "trainer.probe_every: 16 -> 1" in note
    notes = check_resumable(saved, as_dict("trainer.lr=0.001", "trainer.eval_every=5"), "ckpt")
    assert len(notes) == 2 and "trainer.eval_every" in notes[0]
    assert "trainer.lr" in notes[1] and "no longer matches an uninterrupted run" in notes[1]
    assert identity_hash(saved) == identity_hash(as_dict("trainer.lr=0.001"))


def test_keys_newer_than_the_checkpoint_are_not_changes():
    """A checkpoint written before data.max_unencodable_rows existed still resumes."""
    saved = as_dict()
    del saved["data"]["max_unencodable_rows"], saved["trainer"]["resume_allow_changes"]
    assert check_resumable(saved, as_dict(), "ckpt") == []


def test_command_line_keys_split_keys_from_group_choices():
    keys, groups = command_line_keys(
        [
            "+experiment=gkd",
            "data.train_files=[a.jsonl]",
            "+reward.by_source={x: boxed}",
            "rollout=hf_cached",
            "model/student=builtin",
            "hydra.run.dir=out",
            "trainer.resume=auto",
            "~tracking.run_name",
        ]
    )
    assert keys == ["data.train_files", "reward.by_source", "trainer.resume", "tracking.run_name"]
    assert groups == ["+experiment=gkd", "rollout=hf_cached", "model/student=builtin"]


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from miniverl.config import register_configs
    from tests.test_config import CONF

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def test_a_resumed_run_keeps_its_saved_config_and_applies_only_the_keys_set_now():
    """Issue 17: the README's resume command reverted data.train_files and data.chat_template to defaults."""
    saved = as_dict("+experiment=gkd", "data.train_files=[my.jsonl]", "data.chat_template=false", "objective.beta=1.0")
    now = ["+experiment=gkd", "trainer.resume=auto", "trainer.total_steps=600"]
    keys, _ = command_line_keys(now)
    merged, kept = resumed_config(compose(*now), saved, keys)
    cfg = to_config(merged)
    assert cfg.data.train_files == ["my.jsonl"] and cfg.data.chat_template is False and cfg.objective.beta == 1.0
    assert cfg.trainer.resume == "auto" and cfg.trainer.total_steps == 600
    assert {"data.train_files", "data.chat_template", "objective.beta"} <= set(kept)  # said, not applied
    assert check_resumable(saved, dataclasses.asdict(cfg), "ckpt")[0].startswith("resuming with changed run")


def fake_checkpoint(run_dir, step: int, config: dict) -> None:
    """A checkpoint with a valid state.json and no other files (resolve_resume reads only the state)."""
    path = step_dir(run_dir, step)
    path.mkdir(parents=True)
    state = {"step": step, "policy_version": step, "policy_digest": "d", "config": config, "config_hash": "h"}
    state["first_eval"] = {"eval/accuracy": 0.5, "eval/reverse_kl": 1.0}
    (path / "state.json").write_text(json.dumps({**state, "files": {}}))


def test_a_directory_holding_a_run_is_refused_unless_resume_continues_it(tmp_path):
    cfg = load()
    assert resolve_resume(cfg, tmp_path, as_dict()) is None  # fresh directory: a fresh run
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl\).*trainer.resume=auto"):
        resolve_resume(cfg, tmp_path, as_dict())
    with pytest.raises(ConfigError, match="no usable checkpoint"):
        resolve_resume(load("trainer.resume=auto"), tmp_path, as_dict())
    fake_checkpoint(tmp_path, 3, as_dict())
    fake_checkpoint(tmp_path, 5, as_dict())
    logged = []
    auto = load("trainer.resume=auto")
    point = resolve_resume(auto, tmp_path, dataclasses.asdict(auto), logged.append)
    assert point.path == step_dir(tmp_path, 5) and point.step == 5 and point.first_eval["eval/accuracy"] == 0.5
    assert any("trainer.resume: 'none' -> 'auto'" in line for line in logged)
    explicit = load(f"trainer.resume={step_dir(tmp_path, 5)}")
    assert resolve_resume(explicit, tmp_path, dataclasses.asdict(explicit), logged.append).path == step_dir(tmp_path, 5)
    older = load(f"trainer.resume={step_dir(tmp_path, 3)}")
    with pytest.raises(ConfigError, match="is older than step_00000005 in the same run"):
        resolve_resume(older, tmp_path, dataclasses.asdict(older))


def test_resume_refuses_bad_paths_finished_runs_and_other_runs_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="no such checkpoint"):
        resolve_resume(load(f"trainer.resume={tmp_path / 'nope'}"), tmp_path, as_dict())
    other = tmp_path / "other"
    fake_checkpoint(other, 400, as_dict())
    with pytest.raises(ConfigError, match="already finished step 400 of trainer.total_steps=400"):
        resolve_resume(load(f"trainer.resume={step_dir(other, 400)}"), tmp_path / "new", as_dict())
    mine = tmp_path / "mine"
    fake_checkpoint(mine, 2, as_dict())
    with pytest.raises(ConfigError, match="continues another run's checkpoint"):
        resolve_resume(load(f"trainer.resume={step_dir(other, 400)}"), mine, as_dict())
    with pytest.raises(ConfigError, match="model.lora.rank"):
        resolve_resume(load("trainer.resume=auto", "model.lora.rank=4"), mine, as_dict("model.lora.rank=4"))
