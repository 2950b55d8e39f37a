"""Fail closed: each reason verl 0.9 cannot reproduce a run, triggered by a config that causes it; all
reasons listed at once; nothing written when refused."""

from __future__ import annotations

import pytest

from miniverl.bridge.__main__ import REFUSALS_HELP, main
from miniverl.bridge.export import export_verl
from miniverl.bridge.refusals import CHECKS, VerlRefusal, refusal_reasons
from miniverl.bridge.runs import load_run
from tests.bridge.helpers import set_key, write_config, write_prompt_files

# reason code -> the config changes (dotted key: value) that trigger it, alone, on the clean config
CASES = {
    "rollout_backend": {"rollout.backend": "hf_reference"},
    "quantized_student": {"model.student.quantization": "nf4"},
    "teacher_colocated": {"resources.scorer_gpus": 0},
    "multi_teacher": {  # named teachers replace model.teacher, which goes back to its default
        "model.teacher.path": "builtin:teacher",
        "model.teachers": {"rev": {"path": "/models/rev", "dtype": "auto", "quantization": "none"}},
        "model.default_teacher": "rev",
    },
    "no_gpus": {"resources.gpus": 0, "resources.scorer_gpus": 0, "resources.device": "cpu"},
    "gkd_loss": {"objective.name": "gkd", "objective.beta": 0.5},
    "gkd_support": {"objective.name": "gkd", "objective.beta": 0.0, "objective.teacher_topk": 64},
    "gkd_temperature": {
        "objective.name": "gkd",
        "objective.beta": 0.0,
        "objective.teacher_topk": 0,
        "objective.loss_temperature": 2.0,
    },
    "pg_discount": {"objective.discount": 0.5},
    "pg_kl_in_advantage": {"objective.kl_coef": 0.1},
    "pg_reward_weight": {"objective.reward_coef": 0.5},
    "pg_teacher_weight": {"objective.teacher_coef": 0.0, "objective.reward_coef": 1.0},
    "teacher_context": {"data.task": "addition_chat", "data.teacher_demonstrations": 2},
    "teacher_self": {"model.teacher.path": "self", "resources.scorer_gpus": 0},  # no scorer to give GPUs
    "staleness": {"trainer.staleness": 1},
    "lora": {"model.lora.dropout": 0.05},
    "batch_sizes": {"trainer.micro_batch_size": 3},
    "stop_token_ids": {"rollout.stop_token_ids": [5]},
    # a jsonl row whose data_source ('qa') reward.name=auto has no reward for
    "reward_function": {"data.train_files": ["{tmp}/qa.jsonl"], "data.chat_template": False},
    "reward_signature": {"reward.custom_function": "{tmp}/rewards.py:positional"},
    "prompt_tokens": {"model.student.path": "builtin:student"},  # not built in this cache: no tokenizer to ask
}


def _spec(tmp_path, cfg, verl_version="0.9.1"):
    return load_run(write_config(tmp_path / "config.yaml", cfg), verl_version)


def _apply(tmp_path, cfg, changes: dict) -> dict:
    """Set each dotted key ('{tmp}' in a value = tmp_path, where prompt and reward files are written)."""
    write_prompt_files(tmp_path)
    for key, value in changes.items():
        if isinstance(value, str):
            value = value.format(tmp=tmp_path)
        elif isinstance(value, list):
            value = [v.format(tmp=tmp_path) if isinstance(v, str) else v for v in value]
        set_key(cfg, key, value)
    return cfg


def test_clean_config_has_no_reason(tmp_path, clean):
    assert refusal_reasons(_spec(tmp_path, clean)) == []


def test_every_check_has_a_case_and_a_help_line():
    codes = {c.__name__.lstrip("_") for c in CHECKS}
    assert codes == set(CASES) | {"verl_version"}
    for code in codes:
        assert code in REFUSALS_HELP, f"--help does not explain {code}"


@pytest.mark.parametrize("code", sorted(CASES))
def test_refusal_reason(tmp_path, clean, code):
    cfg = _apply(tmp_path, clean, CASES[code])
    reasons = refusal_reasons(_spec(tmp_path, cfg))
    assert code in [r.code for r in reasons], reasons
    out = tmp_path / "export"
    with pytest.raises(VerlRefusal) as err:
        export_verl(tmp_path / "config.yaml", out)
    assert code in str(err.value)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]


def test_unknown_verl_version(tmp_path, clean):
    reasons = refusal_reasons(_spec(tmp_path, clean, verl_version="0.8.0"))
    assert [r.code for r in reasons] == ["verl_version"]
    assert "0.9.1" in reasons[0].message


def test_unknown_verl_version_on_the_command_line(tmp_path, clean, capsys):
    src = write_config(tmp_path / "config.yaml", clean)
    rc = main(["export-verl", str(src), "--out", str(tmp_path / "x"), "--verl-version", "0.10.0"])
    assert rc == 2
    assert "[verl_version]" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_lora_fractional_alpha_and_large_rank(tmp_path, clean):
    set_key(clean, "model.lora.alpha", 12.5)
    set_key(clean, "model.lora.rank", 1024)
    (reason,) = refusal_reasons(_spec(tmp_path, clean))
    assert reason.code == "lora" and "alpha=12.5" in reason.message and "rank=1024" in reason.message


def test_gkd_without_a_built_student_cannot_know_the_vocabulary(tmp_path, clean):
    for key, value in {
        "objective.name": "gkd",
        "objective.beta": 0.0,
        "objective.teacher_topk": 0,
        "model.student.path": "builtin:student",
    }.items():
        set_key(clean, key, value)
    reasons = {r.code: r.message for r in refusal_reasons(_spec(tmp_path, clean))}
    assert set(reasons) == {"gkd_support", "prompt_tokens"} and "config.json" in reasons["gkd_support"]


def test_a_tokenizer_adding_more_than_a_bos_is_refused(tmp_path, clean, student_dir):
    """A tokenizer that also appends EOS to a plain prompt: verl's chat template cannot reproduce that."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    bos, eos = tok.bos_token, tok.eos_token
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, tok.bos_token_id), (eos, tok.eos_token_id)]
    )
    odd = tmp_path / "odd_student"
    tok.save_pretrained(str(odd))
    shutil.copy(student_dir / "config.json", odd / "config.json")
    set_key(clean, "model.student.path", str(odd))
    (reason,) = refusal_reasons(_spec(tmp_path, clean))
    assert reason.code == "prompt_tokens" and eos in reason.message


def test_batch_sizes_that_do_not_split_over_gpus(tmp_path, clean):
    set_key(clean, "resources.gpus", 3)  # 8 prompts x 4 samples = 32 rows over 3 GPUs
    codes = [r.code for r in refusal_reasons(_spec(tmp_path, clean))]
    assert codes == ["batch_sizes"]


def test_all_reasons_listed_at_once(tmp_path, clean):
    for code in ("rollout_backend", "teacher_colocated", "pg_discount", "batch_sizes", "quantized_student"):
        _apply(tmp_path, clean, CASES[code])
    src = write_config(tmp_path / "config.yaml", clean)
    with pytest.raises(VerlRefusal) as err:
        export_verl(src, tmp_path / "out", "0.1.0")
    codes = [r.code for r in err.value.reasons]
    assert codes == [
        "verl_version",
        "rollout_backend",
        "quantized_student",
        "teacher_colocated",
        "pg_discount",
        "batch_sizes",
    ]
    assert not (tmp_path / "out").exists()


def test_forward_quantization_key_that_verl_can_express_is_accepted(tmp_path, clean):
    """model.student.quantization is in the schema now (issue 9) and read typed, as reward.* is; 'none'
    refuses nothing (and is not an unknown-key error)."""
    set_key(clean, "model.student.quantization", "none")
    set_key(clean, "reward.name", "exact_match")
    spec = _spec(tmp_path, clean)
    assert (spec.student_quantization, spec.cfg.reward.name) == ("none", "exact_match")
    assert refusal_reasons(spec) == []


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_verl_engines_are_accepted(tmp_path, clean, backend):
    set_key(clean, "rollout.backend", backend)
    assert refusal_reasons(_spec(tmp_path, clean)) == []


def test_hf_cached_is_refused(tmp_path, clean):
    set_key(clean, "rollout.backend", "hf_cached")
    (reason,) = refusal_reasons(_spec(tmp_path, clean))
    assert reason.code == "rollout_backend" and "hf_cached" in reason.message


def test_stop_ids_name_the_generation_config_fix(tmp_path, clean):
    set_key(clean, "rollout.stop_token_ids", [5, 7])
    (reason,) = refusal_reasons(_spec(tmp_path, clean))
    assert reason.code == "stop_token_ids" and "[5, 7]" in reason.message and "generation_config.json" in reason.message


def test_a_source_without_a_reward_is_named_and_by_source_fixes_it(tmp_path, clean):
    _apply(tmp_path, clean, CASES["reward_function"])
    (reason,) = refusal_reasons(_spec(tmp_path, clean))
    assert reason.code == "reward_function" and "'qa'" in reason.message and "by_source" in reason.message
    set_key(clean, "reward.by_source", {"qa": "exact_match"})
    assert refusal_reasons(_spec(tmp_path, clean)) == []


@pytest.mark.parametrize("function", ["positional", "renamed", "extra_required"])
def test_custom_functions_without_verls_signature_are_refused(tmp_path, clean, function):
    _apply(tmp_path, clean, {"reward.custom_function": "{tmp}/rewards.py:" + function})
    (reason,) = refusal_reasons(_spec(tmp_path, clean))
    assert reason.code == "reward_signature" and "solution_str" in reason.message


def test_a_custom_function_with_verls_signature_is_accepted(tmp_path, clean):
    _apply(tmp_path, clean, {"reward.custom_function": "{tmp}/rewards.py:verl_style"})
    assert refusal_reasons(_spec(tmp_path, clean)) == []


def test_chat_template_true_needs_a_tokenizer_with_one(tmp_path, clean):
    """Prompt files rendered with the chat template: the built tiny tokenizer has none, so verl (like miniVERL)
    could not render them; chat_template=false is raw text, as for built-in tasks."""
    _apply(tmp_path, clean, {"data.train_files": ["{tmp}/math.jsonl"], "data.chat_template": True})
    (reason,) = refusal_reasons(_spec(tmp_path, clean))
    assert reason.code == "prompt_tokens" and "data.chat_template=false" in reason.message
    set_key(clean, "data.chat_template", False)
    assert refusal_reasons(_spec(tmp_path, clean)) == []
