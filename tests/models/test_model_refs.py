"""Model references and loading errors: hub ids with dots, no hub, broken files, mixed built-in/local."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from miniverl.errors import ConfigError
from miniverl.models import hub
from miniverl.models.builtin import SHIPPED_DIR, BuiltinRecipe, builtin_dir, require_competent_teacher
from miniverl.models.hub import HUB_PROBE_TIMEOUT_S, check_model_dir, resolve_model_ref, safetensors_problem
from miniverl.setup.prepare import prepare
from tests.test_config import with_models

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"  # the README's example: a hub id with a dot


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def test_hub_id_with_a_dot_is_not_a_missing_path_and_fails_fast_offline(offline):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        resolve_model_ref(QWEN, "model.student.path", "fix")
    assert time.perf_counter() - start < 1.0
    msg = str(err.value)
    assert "is a hub id, but the hub is unreachable (HF_HUB_OFFLINE is set)" in msg
    assert "does not exist" not in msg and "pass model.student.path=DIR" in msg
    assert f"hf download {QWEN} --local-dir DIR" in msg  # current huggingface-hub ships `hf`, not huggingface-cli


def test_unreachable_hub_is_probed_once_and_briefly(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"hub is unreachable \(127.0.0.1:9: ConnectionRefusedError"):
        resolve_model_ref(QWEN, "model.teacher.path", "fix")
    assert time.perf_counter() - start < HUB_PROBE_TIMEOUT_S


def test_cached_hub_model_is_used_without_the_hub(offline, tmp_path):
    repo = tmp_path / "hub-cache" / "models--Qwen--Qwen2.5-0.5B-Instruct"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model_ref(QWEN, "model.student.path", "fix") == str(snap)


def test_reachable_hub_keeps_the_id(monkeypatch):
    monkeypatch.setattr(hub, "hub_unreachable_reason", lambda: None)
    assert resolve_model_ref(QWEN, "model.student.path", "fix") == QWEN


@pytest.mark.parametrize("path", ["./models/student", "/nowhere/student", "a/b/c", "~/student", "bad id!"])
def test_local_looking_paths_that_do_not_exist(path):
    with pytest.raises(ConfigError, match="does not exist; pass a saved model directory"):
        resolve_model_ref(path, "model.student.path", "fix")


def test_truncated_weights_keep_the_reason_key_and_fix(tmp_path, student_dir, teacher_dir):
    broken = tmp_path / "student"
    shutil.copytree(student_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "truncated" in safetensors_problem(weights)
    with pytest.raises(
        ConfigError, match=r"model.student.path=.*model.safetensors is truncated \(\d+ of \d+ bytes\); re-save"
    ):
        prepare(with_models(broken, teacher_dir))


def test_broken_config_json(tmp_path, student_dir, teacher_dir):
    broken = tmp_path / "teacher"
    shutil.copytree(teacher_dir, broken)
    (broken / "config.json").write_text('{"model_type": "qwen2", ')
    with pytest.raises(ConfigError, match=r"model.teacher.path=.*config.json is unreadable \(JSONDecodeError"):
        prepare(with_models(student_dir, broken))


def test_teacher_accuracy_threshold():
    recipe = BuiltinRecipe("addition", 1, 3)
    require_competent_teacher(0.9, 0.8, recipe, "dir")
    with pytest.raises(ConfigError, match=r"data.task=addition .* greedy accuracy 0.000, below model.builtin_min"):
        require_competent_teacher(0.0, 0.8, recipe, "dir")


def seed_builtin_cache(cache, teacher_dir, accuracy=None):
    """Put the tiny teacher where the built-in build would cache it for data.min_len=2, max_len=4."""
    target = builtin_dir(cache, BuiltinRecipe("reverse", 2, 4)) / "teacher"
    shutil.copytree(teacher_dir, target)
    if accuracy is not None:
        info = json.loads((target / "build.json").read_text())
        (target / "build.json").write_text(json.dumps({**info, "greedy_accuracy": accuracy}))
    return target


def test_local_student_with_builtin_teacher(tmp_path, student_dir, teacher_dir):
    target = seed_builtin_cache(tmp_path / "cache", teacher_dir, accuracy=0.95)
    logs = []
    cfg = with_models(student_dir, "builtin:teacher", f"model.cache_dir={tmp_path / 'cache'}")
    setup = prepare(cfg, log=logs.append)
    assert setup.paths == {"student": str(student_dir), "teacher": str(target)}
    assert any("built-in teacher for task 'reverse': greedy accuracy 0.950" in line for line in logs)


def test_incompetent_builtin_teacher_stops_the_run(tmp_path, student_dir, teacher_dir):
    seed_builtin_cache(tmp_path / "cache", teacher_dir, accuracy=0.1)
    cfg = with_models(student_dir, "builtin:teacher", f"model.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ConfigError, match="greedy accuracy 0.100, below model.builtin_min_teacher_accuracy=0.8"):
        prepare(cfg)


def model_copy(tmp_path, model_dir, *remove: str):
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    for name in remove:
        (copy / name).unlink()
    return copy


@pytest.mark.parametrize(
    ("remove", "named"),
    [
        (("tokenizer.json",), r"no tokenizer files \(tokenizer.json, or a vocabulary"),
        (("tokenizer_config.json",), r"no tokenizer_config.json \(the tokenizer's special tokens and chat template\)"),
        (("model.safetensors",), r"no weights \(\*.safetensors, pytorch_model.bin, or an index of shards\)"),
        (
            ("tokenizer.json", "tokenizer_config.json", "model.safetensors", "build.json"),
            r"holds only config.json: no tokenizer files .*; no tokenizer_config.json .*; no weights .*; re-save",
        ),
    ],
)
def test_a_directory_missing_what_a_load_needs_names_each_piece(tmp_path, student_dir, remove, named):
    broken = model_copy(tmp_path, student_dir, *remove)
    with pytest.raises(ConfigError, match=named) as err:
        check_model_dir(broken, "model.student.path", "re-save")
    assert "\n" not in str(err.value)
    check_model_dir(broken, "model.student.path", "re-save", loads=False)  # the fit planner reads config.json alone


def test_a_missing_tokenizer_is_refused_before_the_vocabulary_check(tmp_path, student_dir, teacher_dir):
    """It was reported as "vocabulary differs (43 vs 1 tokens)" by the check of teacher against student."""
    broken = model_copy(tmp_path, teacher_dir, "tokenizer.json")
    with pytest.raises(ConfigError, match=r"model.teacher.path=.*model' cannot load: no tokenizer files"):
        prepare(with_models(student_dir, broken))


def test_an_index_naming_absent_shards_is_refused(tmp_path, student_dir):
    broken = model_copy(tmp_path, student_dir, "model.safetensors")
    shards = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(shards))
    shutil.copy(student_dir / "model.safetensors", broken / "model-00001-of-00002.safetensors")
    with pytest.raises(
        ConfigError, match=r"names 1 shard\(s\) that are not there \(model-00002-of-00002.safetensors\)"
    ):
        check_model_dir(broken, "model.student.path", "re-save")
    shutil.copy(student_dir / "model.safetensors", broken / "model-00002-of-00002.safetensors")
    check_model_dir(broken, "model.student.path", "re-save")


def test_the_shipped_models_and_a_hub_snapshot_pass(tmp_path, student_dir):
    shipped = sorted(SHIPPED_DIR.glob("*/*/config.json"))
    assert len(shipped) >= 4
    for config in shipped:
        check_model_dir(config.parent, "model.student.path", "rebuild")
    # a hub snapshot's files are symlinks into its blobs
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / ("a" * 40)
    shutil.copytree(student_dir, blobs)
    snap.mkdir(parents=True)
    for f in blobs.iterdir():
        (snap / f.name).symlink_to(f)
    check_model_dir(snap, "model.student.path", "download it again")


def test_a_bare_name_offline_lists_the_short_names(offline):
    with pytest.raises(ConfigError, match=r"or name a shipped model by its short name \(smollm2-135m-instruct\)"):
        resolve_model_ref("tinyllama", "model.student.path", "fix")


def test_a_directory_of_a_gguf_file_names_the_file(tmp_path):
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"for its GGUF file pass the file itself \(model.student.path=.*Q4_0.gguf\)"):
        resolve_model_ref(str(tmp_path), "model.student.path", "fix")
