"""The bridge checked by verl itself: verl 0.9.1 from PyPI in its own virtualenv (scripts/make_verl_venv.sh),
called as a subprocess because its pins (transformers < 5.11, tensordict <= 0.10) clash with ours.

Without that virtualenv these tests skip, saying how to create it; .ci/run creates it and sets
MINIVERL_REQUIRE_VERL=1, which turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from miniverl.batches import RolloutBatch, TeacherScores
from miniverl.bridge import batches
from miniverl.bridge.export import export_verl
from miniverl.bridge.translate import flatten
from miniverl.bridge.verl_check import KL_KINDS
from miniverl.data.prompts import PromptSource
from miniverl.objectives import grpo_advantages, kl_penalty
from tests.bridge.helpers import set_key, write_config, write_prompt_files

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("MINIVERL_VERL_VENV", "~/.cache/miniverl/verl-venv")).expanduser()
VERL_PYTHON = VENV / "bin" / "python"
CHECK_TIMEOUT_S = 300  # one verl import plus a Hydra compose takes seconds; a hang should not stall CI


@pytest.fixture(scope="module")
def verl_python() -> Path:
    if not VERL_PYTHON.exists():
        why = f"no verl virtualenv at {VENV}; create it with scripts/make_verl_venv.sh (or set MINIVERL_VERL_VENV)"
        if os.environ.get("MINIVERL_REQUIRE_VERL") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return VERL_PYTHON


def run_check(python: Path, *args: str, expect_ok: bool = True) -> dict | str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [str(python), "-m", "miniverl.bridge.verl_check", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT_S,
    )
    if not expect_ok:
        assert proc.returncode != 0, proc.stdout
        return proc.stderr
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_composed(result: dict, export_dir: Path) -> None:
    overrides = flatten(yaml.safe_load((export_dir / "verl_overrides.yaml").read_text()))
    assert result["ok"] and result["verl_version"] == "0.9.1"
    assert result["composed"].keys() == overrides.keys()
    for key, value in overrides.items():
        assert result["composed"][key] == value, key  # every override landed on an existing verl key


def test_pg_k1_export_passes_verl_config_validation(tmp_path, clean, verl_python):
    out = export_verl(write_config(tmp_path / "c.yaml", clean), tmp_path / "e")
    result = run_check(verl_python, "config", str(out))
    _assert_composed(result, out)
    assert result["dataclasses"]["distillation"] == "DistillationConfig"
    assert result["need_critic"] is False and result["need_reference_policy"] is False
    assert result["reward_probe"] == [1.0, 0.0, 0.0]  # verl loaded and called the exported exact match


def test_token_budget_exports_as_verls_dynamic_batch_size(tmp_path, clean, verl_python):
    set_key(clean, "trainer.max_tokens_per_micro_batch", 4096)
    out = export_verl(write_config(tmp_path / "c.yaml", clean), tmp_path / "e")
    result = run_check(verl_python, "config", str(out))
    _assert_composed(result, out)
    composed = result["composed"]
    assert composed["actor_rollout_ref.actor.use_dynamic_bsz"] is True
    for key in (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    ):
        assert composed[key] == 4096, key


def test_gkd_export_passes_verl_config_validation(tmp_path, clean, student_dir, teacher_dir, verl_python):
    for key, value in {
        "objective.name": "gkd",
        "objective.beta": 0.0,
        "objective.teacher_topk": 0,
        "model.student.path": str(student_dir),
        "model.teacher.path": str(teacher_dir),
    }.items():
        set_key(clean, key, value)
    out = export_verl(write_config(tmp_path / "c.yaml", clean), tmp_path / "e")
    _assert_composed(run_check(verl_python, "config", str(out)), out)


def test_verl_tokenizes_the_exported_prompts_as_the_run_did(tmp_path, clean, student_dir, verl_python):
    """verl's RLHFDataset reads the exported parquet and its chat-template code, with the exported template,
    gives the prompt tokens miniVERL's PromptSource gives (BOS included), row for row and in step order."""
    from transformers import AutoTokenizer

    out = export_verl(write_config(tmp_path / "c.yaml", clean), tmp_path / "e")
    verl = run_check(verl_python, "prompts", str(out), str(student_dir))
    d = clean["data"]
    source = PromptSource(
        d["task"], d["min_len"], d["max_len"], AutoTokenizer.from_pretrained(str(student_dir)), 32, d["seed"]
    )
    ours = [source.batch(step, d["prompts_per_step"]) for step in range(clean["trainer"]["total_steps"])]
    assert verl["uid"] == [u for b in ours for u in b.uid]
    assert verl["ground_truth"] == [a for b in ours for a in b.ground_truth]
    assert verl["prompt_ids"] == [ids for b in ours for ids in b.prompt_ids]


def _file_run(tmp_path, clean, **changes) -> dict:
    write_prompt_files(tmp_path)
    set_key(clean, "data.train_files", [str(tmp_path / "math.jsonl")])
    set_key(clean, "data.chat_template", False)
    for key, value in changes.items():
        set_key(clean, key, value)
    return clean


# (data_source, response, ground truth, miniVERL's score): one row per auto route, and the rows where verl's
# own default_compute_score rules differ from miniVERL's (why the export carries miniVERL's scorers)
REWARD_PROBES = [
    ("openai/gsm8k", "2+2 #### 4", "4", 1.0),
    ("openai/gsm8k", "2+2 #### 4.0", "4", 1.0),  # verl's gsm8k compares strings: 0
    ("openai/gsm8k", "2+2 ####4", "4", 1.0),  # verl's needs '#### ' with a space: 0
    ("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "\\boxed{2.0}", "2", 1.0),  # verl's MATH rule compares normalized strings: 0
    ("jsonl", "4", "4", 1.0),
    ("jsonl", "4.0", "4", 0.0),
]


def test_verl_calls_the_routed_reward_as_miniverl_scores(tmp_path, clean, verl_python):
    """verl loads the exported reward itself and, called as its reward manager calls it, gives miniVERL's
    score on every auto route; its own default_compute_score gives other scores on some of these rows."""
    from miniverl.rewards import REWARDS, SOURCE_REWARDS

    out = export_verl(write_config(tmp_path / "c.yaml", _file_run(tmp_path, clean)), tmp_path / "e")
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps([p[:3] for p in REWARD_PROBES]))
    result = run_check(verl_python, "config", str(out), str(probes))
    _assert_composed(result, out)
    ours = [REWARDS.get(SOURCE_REWARDS[source])(text, truth) for source, text, truth, _ in REWARD_PROBES]
    assert result["reward_probe"] == ours == [p[3] for p in REWARD_PROBES]
    assert result["verl_default_probe"] == [1.0, 0.0, 0.0, 1.0, 0.0, None, None]


def test_verl_loads_a_custom_reward_function(tmp_path, clean, verl_python):
    spec = str(tmp_path / "rewards.py") + ":verl_style"
    out = export_verl(
        write_config(tmp_path / "c.yaml", _file_run(tmp_path, clean, **{"reward.custom_function": spec})),
        tmp_path / "e",
    )
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps([["jsonl", " 4 ", "4"], ["jsonl", "5", "4"]]))
    result = run_check(verl_python, "config", str(out), str(probes))
    _assert_composed(result, out)
    assert result["reward_probe"] == [1.0, 0.0]


@pytest.mark.parametrize("chat_template", [False, True])
def test_verl_tokenizes_a_file_runs_prompts_as_the_run_did(
    tmp_path, clean, templated_student, verl_python, chat_template
):
    """Prompt files, raw text or through the tokenizer's own chat template: verl's RLHFDataset and
    chat-template code give the ids miniVERL's FilePromptSource gives, in its step order."""
    from transformers import AutoTokenizer

    from miniverl.config import DataConfig
    from miniverl.data.build import build_prompt_source

    cfg = _file_run(
        tmp_path, clean, **{"data.chat_template": chat_template, "model.student.path": str(templated_student)}
    )
    out = export_verl(write_config(tmp_path / "c.yaml", cfg), tmp_path / "e")
    verl = run_check(verl_python, "prompts", str(out), str(templated_student))
    d = DataConfig(**{**cfg["data"], "train_files": cfg["data"]["train_files"], "val_files": []})
    tok = AutoTokenizer.from_pretrained(str(templated_student))
    source = build_prompt_source(d, tok, cfg["trainer"]["total_steps"], log=lambda _: None)
    ours = [source.batch(step, d.prompts_per_step) for step in range(cfg["trainer"]["total_steps"])]
    assert verl["uid"] == [u for b in ours for u in b.uid]
    assert verl["prompt_ids"] == [ids for b in ours for ids in b.prompt_ids]
    text = tok.decode(verl["prompt_ids"][0])
    assert ("assistant" in text) == chat_template  # the template really was applied (or not)


def test_verl_validation_can_fail(tmp_path, clean, verl_python):
    """The check is real: an export edited into something verl rejects (a directly backpropagated k1 loss)
    fails in verl's own DistillationLossConfig."""
    out = export_verl(write_config(tmp_path / "c.yaml", clean), tmp_path / "e")
    tree = yaml.safe_load((out / "verl_overrides.yaml").read_text())
    tree["distillation"]["distillation_loss"]["use_policy_gradient"] = False
    (out / "verl_overrides.yaml").write_text(yaml.safe_dump(tree))
    err = run_check(verl_python, "config", str(out), expect_ok=False)
    assert "k1 loss" in err


B, TP, TR = 6, 2, 4
UID = ["a", "a", "a", "b", "b", "c"]  # groups of 3, 2 and 1 (verl: a group of one has mean 0, std 1)


def exported_batch(path: Path) -> tuple[RolloutBatch, dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    batch = RolloutBatch(
        prompts=torch.randint(1, 9, (B, TP), generator=g),
        prompt_mask=torch.ones(B, TP, dtype=torch.long),
        responses=torch.randint(1, 9, (B, TR), generator=g) * response_mask,
        response_mask=response_mask,
        rollout_log_probs=(-torch.rand(B, TR, generator=g) * response_mask).float(),
        uid=UID,
        ground_truth=["x"] * B,
        policy_version=3,
    )
    # log-probs spread wide enough to reach k3's clamps (log-ratio beyond +-20, value beyond 10)
    old = -torch.rand(B, TR, generator=g) * 30
    ref = -torch.rand(B, TR, generator=g) * 30
    columns = {"old_log_probs": old.float(), "ref_log_prob": ref.float(), "advantages": torch.randn(B, TR, generator=g)}
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 2.0])  # group b is constant: advantage 0
    scores = TeacherScores(-torch.rand(B, TR, generator=g))
    batches.save_batch(path, batch, scores, rewards, columns)
    return batch, columns, rewards


def test_dataproto_from_an_exported_batch(tmp_path, verl_python):
    _, columns, _ = exported_batch(tmp_path / "b")
    result = run_check(verl_python, "dataproto", str(tmp_path / "b"))
    assert result["type"] == "verl.protocol.DataProto" and result["len"] == B
    t = result["tensors"]
    assert t["prompts"] == ["int64", [B, TP]] and t["responses"] == ["int64", [B, TR]]
    assert t["input_ids"] == ["int64", [B, TP + TR]] and t["response_mask"] == ["int64", [B, TR]]
    assert t["teacher_logprobs"] == ["float32", [B, TR, 1]] and t["token_level_rewards"] == ["float32", [B, TR]]
    assert set(columns) <= set(t)
    assert result["non_tensors"]["uid"] == UID
    assert result["meta_info"]["policy_version"] == 3


def test_verl_kl_penalty_and_grpo_equal_miniverl(tmp_path, verl_python):
    batch, columns, rewards = exported_batch(tmp_path / "b")
    run_check(verl_python, "algos", str(tmp_path / "b"), str(tmp_path / "verl.safetensors"))
    from safetensors.torch import load_file

    verl = load_file(str(tmp_path / "verl.safetensors"))
    old, ref = columns["old_log_probs"], columns["ref_log_prob"]
    assert bool(((ref - old).abs() > 20).any()), "the data must reach k3's log-ratio clamp"
    for kind in KL_KINDS:
        torch.testing.assert_close(kl_penalty(old, ref, kind), verl[f"kl_{kind}"], rtol=0, atol=0, msg=kind)
    mask = batch.response_mask.float()
    for norm in (True, False):
        ours = grpo_advantages(rewards, UID, norm_by_std=norm).unsqueeze(1) * mask  # [B, Tr]
        torch.testing.assert_close(ours, verl[f"grpo_norm_{norm}"], rtol=1e-6, atol=1e-6, msg=f"norm={norm}")


def test_verl_agrees_with_the_batch_size_refusal(tmp_path, clean, verl_python):
    """The batch_sizes refusal is verl's own rule: 8 prompts x 4 samples over 3 GPUs fails verl's validation."""
    out = export_verl(write_config(tmp_path / "c.yaml", clean), tmp_path / "e")
    tree = yaml.safe_load((out / "verl_overrides.yaml").read_text())
    tree["trainer"]["n_gpus_per_node"] = 3
    (out / "verl_overrides.yaml").write_text(yaml.safe_dump(tree))
    err = run_check(verl_python, "config", str(out), expect_ok=False)
    assert "must be divisible by minimal possible batch size" in err
