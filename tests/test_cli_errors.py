"""The command line's last rough edges (issue 38): a run directory that cannot be made, the dict form of a
dict-valued key, and a malformed override. Each either composes as the working form does or ends in one line
naming the key and the fix, before Hydra composes the run (and so before Ray). miniverl/setup/argv.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from miniverl.config import register_configs
from miniverl.errors import ConfigError
from miniverl.setup import argv
from miniverl.setup.argv import check_run_dir, checked_command_line

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUN_DIR = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"  # conf/config.yaml's


def run_main(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "miniverl.main", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def composed(*overrides: str) -> dict:
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_container(compose(config_name="config", overrides=list(overrides)))


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The refusal: exit code 2 and one line on stderr, before Ray (its dashboard line) and without a traceback."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miniverl: error: "), proc.stderr[-2000:]
    assert "Ray dashboard" not in proc.stdout
    return lines[0]


# 1. hydra.run.dir that cannot be made: Hydra made it before main ran, in a FileExistsError traceback.


def test_a_run_directory_that_is_a_file_is_refused_in_one_line(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a run")
    line = one_error_line(run_main(f"hydra.run.dir={taken}"))
    assert f"hydra.run.dir={taken} is a file, not a directory. Fix: set hydra.run.dir to a new directory" in line
    assert taken.read_text() == "not a run"


def test_a_run_directory_under_a_file_or_a_locked_directory_is_refused(tmp_path, monkeypatch):
    taken = tmp_path / "taken"
    taken.write_text("")
    with pytest.raises(ConfigError, match=f"hydra.run.dir={taken}/run cannot be created: {taken} is a file"):
        checked_command_line([f"hydra.run.dir={taken}/run"], DEFAULT_RUN_DIR)
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access  # root may write anywhere, so the permission is what os.access says
    monkeypatch.setattr(argv.os, "access", lambda p, mode: Path(p) != locked and access(p, mode))
    with pytest.raises(ConfigError, match=f"cannot be created: this user may not write to {locked}. Fix: set"):
        check_run_dir(f"{locked}/a/run")
    with pytest.raises(ConfigError, match=f"hydra.run.dir={locked} cannot be written"):
        check_run_dir(str(locked))
    assert not any(locked.iterdir())


def test_a_run_directory_where_no_directory_can_be_made_is_refused_whatever_the_permission_bits(tmp_path, monkeypatch):
    """/proc says writable to root but makes no directory: Hydra's mkdir ended in a traceback. The check makes and
    removes one probe directory, so it leaves nothing behind either way."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc on this system")
    with pytest.raises(
        ConfigError,
        match=r"hydra.run.dir=/proc/nope/run cannot be created: (/proc refuses a new directory \([^)]+\)|this user"
        r" may not write to /proc)\. Fix: set",
    ):
        check_run_dir("/proc/nope/run")
    refusing = tmp_path / "refusing"
    refusing.mkdir()

    def read_only(**kw):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(argv.tempfile, "mkdtemp", read_only)
    with pytest.raises(ConfigError, match=f"{refusing} refuses a new directory \\(Read-only file system\\)"):
        check_run_dir(f"{refusing}/run")
    monkeypatch.undo()
    check_run_dir(f"{refusing}/a/run")
    assert not any(refusing.iterdir())  # the probe is gone and nothing was made


def test_a_usable_run_directory_passes(tmp_path, monkeypatch):
    check_run_dir(str(tmp_path))  # an existing directory (a run to continue)
    check_run_dir(str(tmp_path / "new" / "run"))
    check_run_dir(f"{tmp_path}/${{now:%H}}/x")  # the part after an interpolation is not known yet
    (tmp_path / "outputs").write_text("")  # ... but the literal head is checked, the default's `outputs` too
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="outputs is a file"):
        checked_command_line(["+experiment=gkd"], DEFAULT_RUN_DIR)
    assert not (tmp_path / "new").exists()


# 2. The dict form of a dict-valued key: Hydra's bare "Could not override" unless the experiment named the key.


@pytest.mark.parametrize("experiment", ["gkd", "mopd"])  # mopd names sort in both dicts, gkd neither
def test_the_dict_form_composes_as_the_form_hydra_accepts(experiment):
    mine = [
        "trainer.loss_weight_by_source={sort: 4}",
        "trainer.loss_weight_by_source.reverse=2",
        "+trainer.loss_weight_by_source.copy=3",
        "reward.by_source={jsonl: nope}",
        "+model.teachers.extra={path: x}",
        "model.teachers.sort.path=y",
    ]
    accepted = [  # the forms Hydra accepted on every experiment before
        "+trainer.loss_weight_by_source={sort: 4, reverse: 2, copy: 3}",
        "+reward.by_source={jsonl: nope}",
        "+model.teachers={extra: {path: x}, sort: {path: y}}",
    ]
    config = composed(*checked_command_line([f"+experiment={experiment}", *mine], DEFAULT_RUN_DIR))
    assert config == composed(f"+experiment={experiment}", *accepted)
    assert config["trainer"]["loss_weight_by_source"] == {"sort": 4.0, "reverse": 2.0, "copy": 3.0}
    assert config["reward"]["by_source"] == {"jsonl": "nope"}
    teachers = {name: spec["path"] for name, spec in config["model"]["teachers"].items()}
    kept = {"reverse": "builtin:teacher/reverse"} if experiment == "mopd" else {}  # merged in, as before
    assert teachers == {"extra": "x", "sort": "y", **kept}
    if experiment == "gkd":  # what the user saw before
        with pytest.raises(ConfigCompositionException, match="Could not override 'trainer.loss_weight_by_source'"):
            composed("+experiment=gkd", "trainer.loss_weight_by_source={sort: 4}")


def test_other_overrides_pass_unchanged(tmp_path):
    argv = [
        "+experiment=gkd",
        "--cfg",
        "job",
        "trainer.lr=1e-3",
        "model.lora={rank: 8}",  # a dataclass, not a dict: its keys are fixed
        "model/student=builtin",
        "data.train_files=['a b.jsonl']",
        "+trainer.loss_weight_by_source={sort: 4}",
        "+model.teacher_by_source={openai/gsm8k: math}",
        "trainer.loss_weight_by_sorce={sort: 4}",  # misspelled: Hydra's own error names it
        "~trainer.lr",
        "model.lora.target_modules.0=q_proj",  # a list's index: Hydra's to set
        "reward.custom_function=/r.py:score",
        f"hydra.run.dir={tmp_path}/${{now:%H}}",
    ]
    assert checked_command_line(argv, DEFAULT_RUN_DIR) == argv


def test_main_accepts_the_dict_form_on_an_experiment_that_does_not_name_the_key():
    proc = run_main("+experiment=gkd", "trainer.loss_weight_by_source={sort: 4}", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert OmegaConf.create(proc.stdout).trainer.loss_weight_by_source == {"sort": 4.0}


# 3. A malformed override: Hydra's grammar error, without the override's name, and "HYDRA_FULL_ERROR=1".


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.total_steps=[1,2", r"its '\[' is never closed. Fix: close it with '\]'"),
        ("trainer.total_steps={a: [1,2}", r"its '\[' is closed by a '}'. Fix: close it with '\]'"),
        ("trainer.total_steps=1]", r"its '\]' closes nothing. Fix: drop it"),
        ("data.train_files='a.jsonl", "its quote ' is never closed"),
        ("trainer.total_steps", "it has no '='. Fix: key=value"),
        ("trainer lr=1", "its key cannot hold ' '"),
        ("data.task=a^b", "its value cannot hold '\\^' unquoted. Fix: quote"),
        ("trainer.lr=1e-3,2e-3", r"several values \(a sweep\). Fix: a list is key=\[a,b\]"),
        ("trainer.seed=3", r"sets trainer.seed, which was removed: it was read by nothing. Fix: .*rollout.seed"),
        ("+trainer.seed=3", r"which was removed: .* data.seed .* model.lora.init_seed"),
        # verl's custom_reward_function.path and .name: one value here (Hydra said "Cannot convert 'dict' to string")
        (
            "reward.custom_function.path=/r.py",
            r"under reward.custom_function, which is one value, not a section: path/to/file.py:name .*"
            r"Fix: reward.custom_function=<value>",
        ),
        ("trainer.total_steps.x=1", r"under trainer.total_steps, which is one value, not a section: an int"),
        (
            "~model.student.path.x",
            r"removes a key under model.student.path, .* \(or ~model.student.path to remove it\)",
        ),
    ],
)
def test_a_malformed_override_is_named_with_what_is_wrong(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        checked_command_line(["+experiment=gkd", override], DEFAULT_RUN_DIR)
    assert f"'{override}'" in str(err.value)


def test_a_sweep_is_an_override_under_multirun():
    argv = ["--multirun", "trainer.lr=1e-3,2e-3"]
    assert checked_command_line(argv, DEFAULT_RUN_DIR) == argv


def test_main_refuses_a_malformed_override_in_one_line():
    line = one_error_line(run_main("+experiment=gkd", "trainer.total_steps=[1,2"))
    assert line.startswith("miniverl: error: cannot read the override 'trainer.total_steps=[1,2': its '[' is never")


@pytest.mark.parametrize(
    ("arg", "expanded"),
    [
        ("data.train_files=~/d/train.parquet", "data.train_files={home}/d/train.parquet"),
        ("data.train_files=[~/a.jsonl,~/b.jsonl]", "data.train_files=[{home}/a.jsonl,{home}/b.jsonl]"),
        ("hydra.run.dir=~/runs/a", "hydra.run.dir={home}/runs/a"),
        ("data.train_files='~/quoted.jsonl'", "data.train_files='~/quoted.jsonl'"),  # quoted: left to Hydra
        ("data.val_files=[v.jsonl,~]", "data.val_files=[v.jsonl,{home}]"),
        ("~trainer.lr", "~trainer.lr"),  # Hydra's delete
    ],
)
def test_a_home_path_in_a_value_is_expanded_as_a_shell_would(tmp_path, monkeypatch, arg, expanded):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert checked_command_line([arg], "outputs/run") == [expanded.format(home=tmp_path)]
