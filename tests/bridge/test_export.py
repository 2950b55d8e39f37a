"""export-verl / export-data end to end on the CPU: files, the YAML and command line agreeing, atomicity."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from miniverl.bridge import data as bridge_data
from miniverl.bridge import export as bridge_export
from miniverl.bridge.__main__ import main
from miniverl.bridge.translate import BOS_PROMPT_TEMPLATE, flatten, hydra_value
from tests.bridge.helpers import set_key, write_config, write_prompt_files


def _command_overrides(script: str) -> dict[str, str]:
    """key -> Hydra value text of every override on the exported command line."""
    words = shlex.split(script.split("\n", 2)[2].replace("\\\n", " "))
    start = words.index("verl.trainer.main_ppo") + 1
    return dict(w.split("=", 1) for w in words[start:])


def test_export_pg_k1_run_dir(tmp_path, clean):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    write_config(run / ".hydra" / "config.yaml", clean)
    out = tmp_path / "export"
    assert main(["export-verl", str(run), "--out", str(out)]) == 0
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "data/test.parquet",
        "data/train.parquet",
        "manifest.json",
        "verl_command.sh",
        "verl_overrides.yaml",
        "verl_reward.py",
    ]
    overrides = flatten(yaml.safe_load((out / "verl_overrides.yaml").read_text()))
    script = (out / "verl_command.sh").read_text()
    assert script.split("\n")[2].startswith("WANDB_MODE=offline python3 -m verl.trainer.main_ppo")
    on_command_line = _command_overrides(script)
    assert on_command_line == {k: hydra_value(v) for k, v in overrides.items()}
    # Hydra's own override parser reads the command line back to the YAML's values
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in on_command_line.items()])
    assert {o.key_or_group: o.value() for o in parsed} == overrides
    # what the run means, in verl's names
    assert overrides["distillation.distillation_loss.loss_mode"] == "k1"
    assert overrides["distillation.distillation_loss.use_policy_gradient"] is True
    assert overrides["distillation.distillation_loss.use_task_rewards"] is True
    assert overrides["distillation.distillation_loss.clip_ratio_high"] == pytest.approx(1.0)  # is_cap 2
    assert overrides["distillation.n_gpus_per_node"] == 1 and overrides["distillation.enabled"] is True
    assert overrides["actor_rollout_ref.rollout.n"] == 4 and overrides["actor_rollout_ref.rollout.top_k"] == -1
    assert overrides["data.train_batch_size"] == 8 and overrides["actor_rollout_ref.actor.ppo_mini_batch_size"] == 8
    # the built-in tokenizer puts a BOS before the prompt text, so the template does too
    assert overrides["actor_rollout_ref.model.custom_chat_template"] == BOS_PROMPT_TEMPLATE
    assert overrides["actor_rollout_ref.model.path"] == clean["model"]["student"]["path"]
    assert overrides["data.train_files"] == str(out / "data" / "train.parquet")
    # data: total_steps x prompts_per_step training rows in step order, the eval prompts as the test split
    train = bridge_data.read_parquet(out / "data" / "train.parquet")
    assert [r["extra_info"]["uid"] for r in train[:2]] == ["s0-0", "s0-1"] and len(train) == 3 * 8
    assert len(bridge_data.read_parquet(out / "data" / "test.parquet")) == 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verl_version"] == "0.9.1" and manifest["rows"] == {"train": 24, "test": 4}


def test_exported_reward_is_exact_match(tmp_path, clean):
    out = bridge_export.export_verl(write_config(tmp_path / "c.yaml", clean), tmp_path / "e")
    namespace: dict = {}
    exec((out / "verl_reward.py").read_text(), namespace)
    score = namespace["compute_score"]
    assert score("reverse", "cba", "cba", {}) == 1.0
    assert score("reverse", "cb", "cba", {}) == 0.0
    with pytest.raises(ValueError, match="not in the exported rows"):
        score("openai/gsm8k", "#### 4", "4", {})


def test_export_gkd_forward_kl_over_the_whole_vocabulary(tmp_path, clean, student_dir, teacher_dir):
    for key, value in {
        "objective.name": "gkd",
        "objective.beta": 0.0,
        "objective.teacher_topk": 0,
        "model.student.path": str(student_dir),
        "model.teacher.path": str(teacher_dir),
    }.items():
        set_key(clean, key, value)
    out = bridge_export.export_verl(write_config(tmp_path / "c.yaml", clean), tmp_path / "e")
    overrides = flatten(yaml.safe_load((out / "verl_overrides.yaml").read_text()))
    vocab = json.loads((student_dir / "config.json").read_text())["vocab_size"]
    assert overrides["distillation.distillation_loss.loss_mode"] == "forward_kl_topk"
    assert overrides["distillation.distillation_loss.topk"] == vocab
    assert overrides["distillation.distillation_loss.use_policy_gradient"] is False
    assert overrides["distillation.teacher_models.teacher_model.model_path"] == str(teacher_dir)


def test_a_failure_while_writing_leaves_nothing(tmp_path, clean, monkeypatch):
    src = write_config(tmp_path / "c.yaml", clean)

    def broken(rows, path):
        path.write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(bridge_data, "write_parquet", broken)
    with pytest.raises(OSError, match="disk full"):
        bridge_export.export_verl(src, tmp_path / "e")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_existing_out_is_refused(tmp_path, clean, capsys):
    src = write_config(tmp_path / "c.yaml", clean)
    (tmp_path / "e").mkdir()
    assert main(["export-verl", str(src), "--out", str(tmp_path / "e")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_bad_source_names_the_fix(tmp_path, capsys):
    assert main(["export-verl", str(tmp_path / "nothing"), "--out", str(tmp_path / "e")]) == 2
    assert "--cfg job" in capsys.readouterr().err


def test_unknown_key_in_the_config_is_an_error(tmp_path, clean, capsys):
    set_key(clean, "trainer.lr_typo", 1.0)
    src = write_config(tmp_path / "c.yaml", clean)
    assert main(["export-verl", str(src), "--out", str(tmp_path / "e")]) == 2
    assert "lr_typo" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_export_data_from_a_run_and_from_jsonl(tmp_path, clean):
    src = write_config(tmp_path / "c.yaml", clean)
    assert main(["export-data", str(src), "--out", str(tmp_path / "d")]) == 0
    assert len(bridge_data.read_parquet(tmp_path / "d" / "train.parquet")) == 24
    f = tmp_path / "qa.jsonl"
    f.write_text(json.dumps({"q": "ab>", "a": "ba"}) + "\n")
    assert (
        main(["export-data", "--jsonl", str(f), "--prompt-key", "q", "--answer-key", "a", "--out", str(tmp_path / "j")])
        == 0
    )
    (row,) = bridge_data.read_parquet(tmp_path / "j" / "train.parquet")
    assert row["prompt"] == [{"role": "user", "content": "ab>"}] and row["reward_model"]["ground_truth"] == "ba"


def test_export_data_needs_exactly_one_source(tmp_path, capsys):
    assert main(["export-data", "--out", str(tmp_path / "d")]) == 2
    assert "either a run directory" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_help_explains_the_refusals(capsys):
    with pytest.raises(SystemExit):
        main(["export-verl", "--help"])
    text = capsys.readouterr().out
    assert "fails closed" in text and "rollout_backend" in text and "never overwritten" in text


def _file_run(tmp_path, clean, **changes) -> dict:
    """The clean run on math.jsonl (gsm8k, MATH and plain rows) as raw text prompts."""
    write_prompt_files(tmp_path)
    set_key(clean, "data.train_files", [str(tmp_path / "math.jsonl")])
    set_key(clean, "data.chat_template", False)
    for key, value in changes.items():
        set_key(clean, key, value)
    return clean


def _exported_reward(out):
    namespace: dict = {}
    exec((out / "verl_reward.py").read_text(), namespace)
    return namespace


def test_auto_reward_is_routed_per_data_source(tmp_path, clean):
    """reward.name=auto: gsm8k rows get miniVERL's gsm8k scorer, MATH rows boxed, plain rows exact match."""
    out = bridge_export.export_verl(write_config(tmp_path / "c.yaml", _file_run(tmp_path, clean)), tmp_path / "e")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["reward"] == {"openai/gsm8k": "gsm8k", "lighteval/MATH": "boxed", "jsonl": "exact_match"}
    score = _exported_reward(out)["compute_score"]
    assert score("openai/gsm8k", "so 2+2 is #### 4.0", "4") == 1.0  # numbers compared as numbers
    assert score("openai/gsm8k", "4", "4") == 0.0  # no '####' answer
    assert score("lighteval/MATH", "the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert score("jsonl", "4", "4") == 1.0 and score("jsonl", "4.0", "4") == 0.0
    overrides = flatten(yaml.safe_load((out / "verl_overrides.yaml").read_text()))
    assert overrides["reward.custom_reward_function.name"] == "compute_score"
    train = bridge_data.read_parquet(out / "data" / "train.parquet")
    assert len(train) == 3 * 8 and {r["data_source"] for r in train} <= set(manifest["reward"])


def test_reward_name_and_by_source_route_every_row(tmp_path, clean):
    cfg = _file_run(tmp_path, clean, **{"reward.name": "boxed", "reward.by_source": {"jsonl": "gsm8k"}})
    out = bridge_export.export_verl(write_config(tmp_path / "c.yaml", cfg), tmp_path / "e")
    routes = json.loads((out / "manifest.json").read_text())["reward"]
    assert routes == {"openai/gsm8k": "boxed", "lighteval/MATH": "boxed", "jsonl": "gsm8k"}


def test_a_custom_reward_is_exported_as_verls_custom_reward_function(tmp_path, clean):
    cfg = _file_run(tmp_path, clean, **{"reward.custom_function": str(tmp_path / "rewards.py") + ":verl_style"})
    out = bridge_export.export_verl(write_config(tmp_path / "c.yaml", cfg), tmp_path / "e")
    assert (out / "verl_reward.py").read_text() == (tmp_path / "rewards.py").read_text()
    overrides = flatten(yaml.safe_load((out / "verl_overrides.yaml").read_text()))
    assert overrides["reward.custom_reward_function.name"] == "verl_style"
    assert overrides["reward.custom_reward_function.path"] == str(out / "verl_reward.py")


def test_chat_template_prompts_use_the_tokenizers_own_template(tmp_path, clean, templated_student):
    cfg = _file_run(tmp_path, clean, **{"data.chat_template": True, "model.student.path": str(templated_student)})
    out = bridge_export.export_verl(write_config(tmp_path / "c.yaml", cfg), tmp_path / "e")
    overrides = flatten(yaml.safe_load((out / "verl_overrides.yaml").read_text()))
    assert overrides["actor_rollout_ref.model.custom_chat_template"] is None
