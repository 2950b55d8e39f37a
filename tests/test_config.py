"""Configuration: Hydra composition, structured-config errors, and every bad-input check before training."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from miniverl.cluster.actors import check_cluster_resources
from miniverl.config import MiniVerlConfig, register_configs, to_config, validate
from miniverl.errors import ConfigError
from miniverl.models.tokenizer import save_char_tokenizer
from miniverl.setup.prepare import prepare

CONF = Path(__file__).resolve().parents[1] / "conf"


def load(*overrides: str) -> MiniVerlConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    return to_config(cfg)


def with_models(student: Path, teacher: Path, *overrides: str) -> MiniVerlConfig:
    return load(
        f"model.student.path={student}",
        f"model.teacher.path={teacher}",
        "data.min_len=2",
        "data.max_len=4",
        "trainer.total_steps=2",
        *overrides,
    )


def test_experiments_compose_to_the_schema():
    gkd = load("+experiment=gkd")
    assert isinstance(gkd, MiniVerlConfig) and gkd.objective.name == "gkd"
    pg = load("+experiment=pg_k1")
    assert pg.objective.name == "pg_k1" and pg.rollout.temperature == 1.0
    validate(gkd)
    validate(pg)


@pytest.mark.parametrize("name", ["gkd_qwen_gsm8k", "pg_k1_qwen_gsm8k"])
def test_qwen_recipes_compose_and_validate_with_the_users_data(tmp_path, name):
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")  # validate checks that the file exists; reading it is prepare's job
    cfg = load(f"+experiment={name}", f"data.train_files=[{train}]")
    validate(cfg)
    assert cfg.model.student.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.model.teacher.path.endswith("1.5B-Instruct")
    assert cfg.rollout.backend == "hf_cached" and cfg.trainer.micro_batch_size == 2
    assert cfg.rollout.n * cfg.data.prompts_per_step == 16  # both recipes train on 16 rows a step
    assert cfg.objective.name == name.split("_qwen")[0]


def test_unknown_experiment_lists_the_known_ones():
    with pytest.raises(HydraException) as err:
        load("+experiment=nope")
    assert "experiment/nope" in str(err.value) and "gkd" in str(err.value) and "pg_k1" in str(err.value)


@pytest.mark.parametrize("override", ["trainer.bogus=1", "+trainer.bogus=1", "rollout.temprature=0.5"])
def test_unknown_keys_fail_in_hydra(override):
    with pytest.raises((HydraException, OmegaConfBaseException, ConfigError), match="bogus|temprature"):
        load(override)


def test_wrong_types_fail_in_hydra():
    with pytest.raises((HydraException, OmegaConfBaseException)):
        load("trainer.total_steps=many")
    with pytest.raises((HydraException, OmegaConfBaseException)):
        load("+trainer.loss_weight_by_source.sort=heavy")


def test_loss_weights_are_off_by_default_and_mopd_weighs_sorting():
    assert load().trainer.loss_weight_by_source == {}
    assert load("+experiment=mopd_single").trainer.loss_weight_by_source == {}
    mopd = load("+experiment=mopd")
    validate(mopd)
    assert mopd.trainer.loss_weight_by_source == {"sort": 4.0}
    reweighted = load(
        "+experiment=mopd", "trainer.loss_weight_by_source.sort=2", "+trainer.loss_weight_by_source.reverse=0.5"
    )
    validate(reweighted)
    assert reweighted.trainer.loss_weight_by_source == {"sort": 2.0, "reverse": 0.5}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.total_steps=0"], "trainer.total_steps=0"),
        (["trainer.total_steps=-3"], "at least 1 step"),
        (["objective.beta=1.5"], "objective.beta"),
        (["objective.signal_floor=-1"], "objective.signal_floor=-1.0: must be >= 0 nats"),
        (["objective.name=ppo"], "unknown objective 'ppo'; known: gkd, pg_k1"),
        (
            ["rollout.backend=tgi"],
            "unknown rollout backend 'tgi'; known: auto .the default., hf_cached, hf_reference, sglang, vllm",
        ),
        (["data.task=sorting"], "unknown task 'sorting'"),
        (["+experiment=pg_k1", "rollout.temperature=0.7"], "pg_k1 samples at temperature 1"),
        (["rollout.n=0"], "rollout.n=0"),
        (["resources.weight_sync=nvlink"], "resources.weight_sync='nvlink': use auto .* or host"),
        (["trainer.probe_every=0"], r"trainer.probe_every=0: use 1 \(probe every refresh\)"),
        (["data.min_len=5", "data.max_len=2"], "min_len <= max_len"),
        (["objective=pg_k1", "objective.kl_kind=k4"], "objective.kl_kind"),
        (["tracking.wandb_mode=maybe"], "wandb_mode"),
        (["+experiment=pg_k1", "rollout.n=1"], "rollout.n=1: every GRPO group"),
        (["resources.gpus=-1"], "resources.gpus=-1"),
        (["resources.gpus=4", "data.prompts_per_step=2"], "every learner rank needs a prompt group"),
        (["resources.gpus=0", "resources.device=cuda"], "asks for no GPU"),
        (["resources.colocate=true", "resources.gpus=2"], "resources.colocate=true puts one rollout replica"),
        (["resources.colocate=true", "resources.scorer_gpus=1"], "set resources.gpus=1 .* resources.scorer_gpus=0"),
        (["resources.colocate=true", "rollout=vllm"], "resources.colocate=true with rollout=vllm"),
        (
            ["trainer.compile_layers=true", "model.student.quantization=nf4"],
            "compile_layers=true with model.student.quantization=nf4: compiling bitsandbytes",
        ),
        (["resources.switch_interval_ms=0.5"], "switch_interval_ms=0.5 sets how a colocated .* set resources.colocate"),
        (
            ["resources.colocate=true", "resources.switch_interval_ms=0"],
            "switch_interval_ms=0.0: use a positive interval",
        ),
        (["data.overlong=truncate"], "data.overlong='truncate': use filter .* or error"),
        (["data.val_files=[v.jsonl]"], "data.val_files is set but data.train_files is empty"),
        (["data.train_files=[/nowhere/t.parquet]"], r"data.train_files: /nowhere/t.parquet does not exist"),
        (["data.train_files=[/]"], r"data.train_files: / is a directory, not a prompt file"),
        (["+experiment=gkd_qwen_gsm8k"], "data.train_files: .*set-data.train_files.*does not exist"),
        (["reward.name=fuzzy"], "unknown reward 'fuzzy'"),
        (["reward.custom_function=nope.py"], "write it as path/to/file.py:function_name"),
        (["rollout.stop_token_ids=[-1]"], "rollout.stop_token_ids"),
        (["model.builtin_min_teacher_accuracy=2"], "must be in \\[0, 1\\]"),
        (["+experiment=mopd", "trainer.loss_weight_by_source.sort=0"], "sort=0.0: a weight must be a finite"),
        (["+experiment=mopd", "trainer.loss_weight_by_source.sort=-2"], "sort=-2.0: a weight must be a finite"),
        (["+experiment=mopd", "trainer.loss_weight_by_source.sort=nan"], "sort=nan: a weight must be a finite"),
        (
            ["+experiment=mopd", "+trainer.loss_weight_by_source.sorting=2"],
            "data.task=reverse\\+sort has no data_source 'sorting'; its sources are reverse, sort",
        ),
    ],
)
def test_validate_names_the_problem_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load(*overrides))


def test_prepare_accepts_good_models(student_dir, teacher_dir):
    cfg = with_models(student_dir, teacher_dir)
    assert (cfg.trainer.logprob_chunk_tokens, cfg.trainer.gradient_checkpointing) == (None, None)  # chosen below
    setup = prepare(cfg, log=lambda *_: None)
    assert (cfg.trainer.logprob_chunk_tokens, cfg.trainer.gradient_checkpointing) == (0, False)  # the CPU's choice
    assert setup.stop_token_ids == (2,) and setup.vocab_size == 43
    assert setup.prompts.batch(1, 4).prompt_ids == setup.prompts.batch(1, 4).prompt_ids
    assert setup.eval_batch.data_source[0] == "reverse"


def test_missing_model_path(tmp_path, teacher_dir):
    with pytest.raises(ConfigError, match=r"model.student.path=.*does not exist"):
        prepare(with_models(tmp_path / "nowhere", teacher_dir))


def test_model_directory_without_config(tmp_path, teacher_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="without config.json"):
        prepare(with_models(tmp_path / "empty", teacher_dir))


def test_unknown_builtin_model(teacher_dir):
    with pytest.raises(ConfigError, match="builtin:student and builtin:teacher"):
        prepare(with_models("builtin:huge", teacher_dir))


def test_teacher_with_another_vocabulary(tmp_path, student_dir, teacher_dir):
    other = tmp_path / "teacher"
    shutil.copytree(teacher_dir, other)
    save_char_tokenizer(other, alphabet="0123456789abcdefghijklmnopqrstuvwxyzXYZ+=>")
    with pytest.raises(ConfigError, match="tokenizes .* first difference at token 1 .* tokenizer family"):
        prepare(with_models(student_dir, other))


def test_prompt_longer_than_the_limit(student_dir, teacher_dir):
    with pytest.raises(ConfigError, match=r"more than data.max_prompt_length=3; raise data.max_prompt_length"):
        prepare(with_models(student_dir, teacher_dir, "data.max_prompt_length=3"))


def test_cluster_without_the_requested_gpus():
    want = {
        "rollout": {"CPU": 0.5, "GPU": 0.4},
        "scorer": {"CPU": 0.5, "GPU": 0.3},
        "learner": {"CPU": 0.5, "GPU": 0.3},
    }
    check_cluster_resources(want, {"CPU": 2.0, "GPU": 1.0})
    with pytest.raises(
        ConfigError, match=r"1 GPU \(rollout 0.4 \+ scorer 0.3 \+ learner 0.3\) but the Ray cluster has 0"
    ):
        check_cluster_resources(want, {"CPU": 2.0})
    with pytest.raises(ConfigError, match="1.5 CPU"):
        check_cluster_resources(want, {"CPU": 1.0, "GPU": 1.0})


@pytest.mark.parametrize(
    ("experiment", "key", "owner"),
    [
        ("pg_k1", "beta", "gkd"),
        ("pg_k1", "teacher_topk", "gkd"),
        ("gkd", "kl_coef", "pg_k1"),
        ("gkd", "discount", "pg_k1"),
    ],
)
def test_a_key_another_objective_owns_fails_naming_the_key_and_the_fix(experiment, key, owner):
    """main ran `+experiment=pg_k1 objective.beta=0.9` with beta silently ignored (one flat objective config)."""
    from miniverl.main import check_objective_overrides

    expected = rf"objective.{key} is not a setting of objective {experiment} .* belongs to objective {owner}. Fix: drop"
    with pytest.raises(ConfigError, match=expected):
        check_objective_overrides([f"+experiment={experiment}", f"objective.{key}=0.5"])
    with pytest.raises(ConfigError, match=expected):
        load(f"+experiment={experiment}", f"+objective.{key}=0.5")  # forced past Hydra's schema: to_config
    check_objective_overrides([f"+experiment={owner}", f"objective.{key}=0"])  # its own objective: fine


def test_a_misspelled_objective_key_and_a_renamed_objective_are_refused():
    from miniverl.main import check_objective_overrides

    with pytest.raises(ConfigError, match=r"objective.bta is not a setting of objective gkd .* check the spelling"):
        check_objective_overrides(["objective.bta=0.5"])
    with pytest.raises(
        ConfigError, match=r"objective.name=pg_k1 but .* GkdObjectiveConfig's settings; .* objective=pg_k1"
    ):
        validate(load("objective.name=pg_k1"))


def test_the_command_line_refusal_comes_before_ray(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "miniverl.main", "+experiment=pg_k1", "objective.beta=0.9", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "objective.beta is not a setting of objective pg_k1" in out.stderr
    assert "ray" not in out.stderr.lower() and not any(tmp_path.iterdir())


def test_the_12_gib_recipe_is_the_measured_run_11_layout(tmp_path):
    """gkd_4080_12g holds the overrides qlora-4080.md's run 11 ran (6.80 s per step at 11.9 GiB; its queue file has
    the command), nothing else."""
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    queue = (CONF.parent / "lab" / "queues" / "qlora-run11.txt").read_text()
    run11 = re.search(r'TAG=12g-a-compiled-cap OVERRIDES="([^"]+)"', queue).group(1).split()
    data = f"data.train_files=[{train}]"
    recipe = load("+experiment=gkd_4080_12g", data)
    assert recipe == load("+experiment=gkd_4080", data, *run11)
    assert recipe != load("+experiment=gkd_4080", data)
    validate(recipe)
