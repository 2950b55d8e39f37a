"""The learner bench times real updates: its batch passes the learner's own checks (strict sync, sampler gap)."""

from __future__ import annotations

import torch

from lab.bench.learner import (
    exact_sampler,
    objective_for,
    profile_update,
    synthetic_batch,
    synthetic_scores,
    time_updates,
    vary_lengths,
)
from miniverl.models.lora import LoraSettings
from miniverl.process import ProcessSettings
from miniverl.workers.learner import LearnerWorker
from tests.random_models import save_random_qwen2


def _learner(path, objective, micro_batch_size=8):
    return LearnerWorker(
        str(path),
        LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0),
        "float32",
        objective,
        lr=1e-5,
        weight_decay=0.0,
        max_grad_norm=1.0,
        process=ProcessSettings("cpu"),
        micro_batch_size=micro_batch_size,
    )


def test_bench_updates_pass_the_sampler_gap_check(tmp_path):
    save_random_qwen2(tmp_path, hidden_size=32, intermediate_size=64, vocab_size=96)
    batch = synthetic_batch(8, 4, 6, vocab=96, seed=0)
    for name in ("gkd", "pg_k1"):
        learner = _learner(tmp_path, objective_for(name, topk=8))
        scores = synthetic_scores(batch, 96, 8 if name == "gkd" else None, seed=0)
        result = time_updates(learner, batch, scores, warmup=1, repeats=1)
        assert result["trained_tokens"] == 48 and result["tokens_per_s"] > 0
        assert len(result["warmup_update_s"]) == 1 and len(result["update_s"]) == 1  # the warm-up's seconds kept apart
        assert learner.version == 2  # both updates applied, none refused


def test_every_timed_update_gets_the_current_policys_sampler_where_the_version_test_votes(tmp_path):
    """With VERSION_TEST_MIN_ROWS rows the learner votes on which policy sampled: log-probs of the policy before the
    last update are refused (SamplerGapError). The bench must hand each update its current policy's, or its second
    update fails (peers run 9 lost its four learner cells so)."""
    from miniverl.objectives.sampler_check import VERSION_TEST_MIN_ROWS

    save_random_qwen2(tmp_path, hidden_size=32, intermediate_size=64, vocab_size=96)
    batch = synthetic_batch(VERSION_TEST_MIN_ROWS, 4, 6, vocab=96, seed=0)
    learner = _learner(tmp_path, objective_for("gkd", topk=8), micro_batch_size=VERSION_TEST_MIN_ROWS)
    result = time_updates(learner, batch, synthetic_scores(batch, 96, 8, seed=0), warmup=1, repeats=2)
    assert learner.version == 3 and len(result["update_s"]) == 2  # every update applied, none refused


def test_a_bench_update_of_varied_rows_trains_their_real_tokens_and_reports_its_split(tmp_path):
    """Rows of varied lengths (vary_lengths): the update trains the real response tokens only, the forwards carry the
    real prompt and response tokens, and the result holds the last update's split (time/update/<part>)."""
    save_random_qwen2(tmp_path, hidden_size=32, intermediate_size=64, vocab_size=96)
    batch = vary_lengths(synthetic_batch(8, 6, 10, vocab=96, seed=0), 2, 4, seed=0)
    learner = _learner(tmp_path, objective_for("gkd", topk=8))
    result = time_updates(learner, batch, synthetic_scores(batch, 96, 8, seed=0), warmup=1, repeats=1)
    assert result["trained_tokens"] == int(batch.response_mask.sum()) < 80
    assert result["row_tokens"] == int(batch.prompt_mask.sum() + batch.response_mask.sum()) < 8 * 16
    assert set(result["update_split_s"]) == {
        f"time/update/{p}" for p in ("prepare", "gradients", "checks", "optimizer")
    }


def test_exact_sampler_reports_the_learners_logprobs(tmp_path):
    save_random_qwen2(tmp_path, hidden_size=32, intermediate_size=64, vocab_size=96)
    learner = _learner(tmp_path, objective_for("pg_k1", topk=0))
    batch = synthetic_batch(4, 3, 5, vocab=96, seed=1)
    exact = exact_sampler(learner, batch)
    assert not torch.allclose(exact.rollout_log_probs, batch.rollout_log_probs)
    # what the learner computes for its gap check: the same numbers, so the gap is ~0
    learner.publish_policy(include_weights=False)
    import dataclasses

    metrics = learner.update(
        dataclasses.replace(exact, policy_version=learner.version), synthetic_scores(exact, 96, None, 0), None
    )
    assert metrics["sampler_gap_max"] < 1e-5


def test_profiled_update_is_applied_not_refused(tmp_path):
    """The profiled update gets the exact sampler too (the bench's stand-ins sit over the sampler-gap bound)."""
    save_random_qwen2(tmp_path, hidden_size=32, intermediate_size=64, vocab_size=96)
    learner = _learner(tmp_path, objective_for("pg_k1", topk=0))
    batch = synthetic_batch(4, 3, 5, vocab=96, seed=1)
    profile_update(learner, batch, synthetic_scores(batch, 96, None, 0), tmp_path / "p.txt")
    assert learner.version == 1
    assert "by self cpu time" in (tmp_path / "p.txt").read_text()


def test_redrawn_rows_give_every_update_new_lengths_and_the_rate_is_the_updates_own(tmp_path):
    """`draw`: each update its own rows (a run's steps are new micro-batch shapes each time; a repeated batch hides
    per-shape costs); every update is applied and the result keeps each one's tokens."""
    save_random_qwen2(tmp_path, hidden_size=32, intermediate_size=64, vocab_size=96)
    full = synthetic_batch(8, 6, 10, vocab=96, seed=0)
    drawn = []

    def draw(i):
        batch = vary_lengths(full, 2, 4, seed=i)
        drawn.append(batch)
        return batch, synthetic_scores(batch, 96, 8, seed=0)

    learner = _learner(tmp_path, objective_for("gkd", topk=8))
    result = time_updates(learner, full, synthetic_scores(full, 96, 8, seed=0), warmup=1, repeats=2, draw=draw)
    assert learner.version == 3 and len(drawn) == 3
    assert result["trained_tokens_each"] == [int(b.response_mask.sum()) for b in drawn[1:]]
    assert len(set(result["trained_tokens_each"] + [int(drawn[0].response_mask.sum())])) > 1  # new lengths
    middle = sorted(range(2), key=result["update_s"].__getitem__)[1]  # the median of two: the slower
    assert result["tokens_per_s"] == result["trained_tokens_each"][middle] / result["update_s"][middle]


def test_the_bench_script_runs_a_redrawn_cell_and_refuses_one_without_varied_rows(tmp_path):
    """lab/bench_learner.py on the CPU at the tiny shape: a redraw cell is timed; a redraw cell of fixed rows is
    written as failed with the reason, and the run goes on."""
    import json
    import subprocess
    import sys

    cell = {
        "objective": "gkd",
        "rows": 8,
        "prompt_tokens": 6,
        "response_tokens": 10,
        "topk": 8,
        "warmup": 1,
        "repeats": 2,
        "settings": {"micro_batch_size": 8},
        "redraw": True,
    }
    cells = [{**cell, "name": "redrawn", "prompt_min": 2, "response_median": 4}, {**cell, "name": "fixed-redraw"}]
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    out = tmp_path / "out.jsonl"
    args = ["--cells", str(tmp_path / "cells.json"), "--out", str(out), "--shape", "tiny"]
    proc = subprocess.run(
        [sys.executable, "lab/bench_learner.py", *args, "--model-dir", str(tmp_path / "models")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    redrawn, fixed = (json.loads(line) for line in out.read_text().splitlines())
    assert redrawn["ok"] and len(redrawn["trained_tokens_each"]) == 2 and redrawn["tokens_per_s"] > 0
    assert not fixed["ok"] and "redraw draws new row lengths each update" in fixed["error"]
