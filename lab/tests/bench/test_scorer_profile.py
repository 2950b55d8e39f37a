"""The scorer profile (lab/bench/scorer_profile.py) on the CPU with a tiny teacher: it times score(), splits a
profiled call into the phases score() labels, and refuses bad arguments before loading anything."""

from __future__ import annotations

import json

import pytest
import torch

from lab.bench import scorer_profile


def test_a_tiny_profile_times_the_scoring_and_splits_it_by_phase(random_model_dir, tmp_path):
    result = scorer_profile.main(
        ["--teacher", str(random_model_dir), "--out", str(tmp_path), "--rows", "8", "--prompt-tokens", "4",
         "--response-tokens", "6", "--topk", "5", "--chunk", "16", "--repeats", "2", "--dtype", "float32",
         "--device", "cpu"]
    )  # fmt: skip
    written = json.loads((tmp_path / "scorer_profile.json").read_text())
    assert written["median_score_s"] == result["median_score_s"] > 0 and len(result["score_s"]) == 2
    assert result["scored_tokens"] == 8 * 6 and result["tokens_per_s"] == pytest.approx(48 / result["median_score_s"])
    phases = result["phases_ms"]
    assert set(phases) == set(scorer_profile.PHASES)
    # 48 response tokens in chunks of 16: the head and the support ran three times each, the forward once
    assert all(phases[p] > 0 for p in ("scorer/forward", "scorer/head", "scorer/support")), phases
    assert result["top_kernels"] and all(k["name"] not in scorer_profile.PHASES for k in result["top_kernels"])


def test_without_a_support_the_support_phase_never_runs(random_model_dir, tmp_path):
    result = scorer_profile.main(
        ["--teacher", str(random_model_dir), "--out", str(tmp_path), "--rows", "4", "--prompt-tokens", "3",
         "--response-tokens", "4", "--topk", "-1", "--repeats", "1", "--dtype", "float32", "--device", "cpu"]
    )  # fmt: skip
    assert result["support_k"] is None and result["phases_ms"]["scorer/support"] == 0.0
    assert result["phases_ms"]["scorer/head"] > 0


def test_varied_lengths_score_only_the_real_tokens(random_model_dir, tmp_path):
    """--prompt-min / --response-median: rows of varied lengths (left-padded prompts, right-padded responses);
    only the real response tokens are scored and counted."""
    result = scorer_profile.main(
        ["--teacher", str(random_model_dir), "--out", str(tmp_path), "--rows", "16", "--prompt-tokens", "8",
         "--response-tokens", "12", "--prompt-min", "2", "--response-median", "3", "--topk", "5", "--repeats", "1",
         "--dtype", "float32", "--device", "cpu"]
    )  # fmt: skip
    shape = result["shape"]
    assert (shape["prompt_min"], shape["response_median"]) == (2, 3)
    assert 16 <= result["scored_tokens"] < 16 * 12 and 16 * 3 <= shape["row_tokens"] < 16 * 20


def test_redrawn_rows_give_every_call_new_lengths(random_model_dir, tmp_path):
    """--redraw: each call scores rows of new lengths (a run's steps are new forward shapes; a repeated batch hides
    per-shape costs such as cuDNN attention's plans); the rate is the median call's own."""
    result = scorer_profile.main(
        ["--teacher", str(random_model_dir), "--out", str(tmp_path), "--rows", "16", "--prompt-tokens", "8",
         "--response-tokens", "12", "--prompt-min", "2", "--response-median", "3", "--topk", "5", "--repeats", "3",
         "--redraw", "--dtype", "float32", "--device", "cpu"]
    )  # fmt: skip
    each = result["scored_tokens_each"]
    assert result["redraw"] and len(each) == 3 and len(set(each)) > 1 and result["scored_tokens"] == each[-1]
    middle = sorted(range(3), key=result["score_s"].__getitem__)[1]
    assert result["tokens_per_s"] == each[middle] / result["score_s"][middle] and not result["cudnn_attention"]


def test_vary_lengths_pads_prompts_left_and_responses_right():
    from lab.bench.learner import synthetic_batch, vary_lengths

    batch = vary_lengths(synthetic_batch(2000, 10, 64, 50, seed=0), 4, 20, seed=0)
    prompts, responses = batch.prompt_mask.sum(1), batch.response_mask.sum(1)
    assert prompts.min() == 4 and prompts.max() == 10 and responses.min() >= 1 and responses.max() <= 64
    assert abs(float(responses.float().median()) - 20) <= 3  # geometric, median ~20
    assert (batch.prompt_mask == (torch.arange(10) >= 10 - prompts[:, None]).long()).all()  # left padding
    assert (batch.response_mask == (torch.arange(64) < responses[:, None]).long()).all()  # right padding
    assert (batch.responses[batch.response_mask == 0] == 0).all() and (
        batch.rollout_log_probs[batch.response_mask == 0] == 0
    ).all()
    full = vary_lengths(synthetic_batch(4, 10, 8, 50, seed=0), 10, 0, seed=0)
    assert full.prompt_mask.all() and full.response_mask.all()  # the defaults: every row full length
    with pytest.raises(ValueError, match="need 1 <= prompt_min <= 10"):
        vary_lengths(synthetic_batch(4, 10, 8, 50, seed=0), 11, 0, seed=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rows", "0"], "--rows=0: must be >= 1"),
        (["--prompt-min", "9", "--prompt-tokens", "8"], "need 0 <= --prompt-min <= --prompt-tokens (8)"),
        (["--response-median", "-1"], "--response-median >= 0 (0: fixed lengths)"),
        (["--topk", "-2"], "--topk=-2: use K >= 1"),
        (["--chunk", "-1"], "--chunk and --max-tokens must be >= 0"),
        (["--share-gib", "4", "--device", "cpu"], "--share-gib caps GPU memory: leave it out on the CPU"),
        (["--redraw"], "--redraw draws new row lengths for every call: give --prompt-min or --response-median"),
    ],
)
def test_bad_arguments_name_the_flag_before_anything_loads(random_model_dir, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        scorer_profile.main(["--teacher", str(random_model_dir), "--out", str(tmp_path), "--device", "cpu", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "scorer_profile.json").exists()


def test_a_teacher_folder_without_a_model_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        scorer_profile.main(["--teacher", str(tmp_path / "nowhere"), "--out", str(tmp_path), "--device", "cpu"])
    assert "no config.json there" in capsys.readouterr().err
