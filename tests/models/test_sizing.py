"""The learner's peak-memory model (models/sizing.py): the measured H200 peaks it was calibrated on, the budget
it picks for a share, and the refusals with their arithmetic."""

from __future__ import annotations

import pytest

from miniverl.errors import ConfigError
from miniverl.models.sizing import (
    LearnerShape,
    check_token_budget,
    fit_tokens,
    learner_peak_bytes,
    scorer_tokens,
)

GIB = 2**30
# Qwen2.5-0.5B shape in bf16 with LoRA r32 on every linear layer (the learner-throughput bench's student).
STUDENT = LearnerShape(
    layers=24, hidden=896, intermediate=4864, vocab=151_936, weight_bytes=988_000_000, adapter_params=17_596_416
)
TEACHER = LearnerShape(
    layers=28, hidden=1536, intermediate=8960, vocab=151_936, weight_bytes=3_090_000_000, adapter_params=0
)


@pytest.mark.parametrize(
    "tokens, chunk, measured_gib",
    [(16_000, 256, 3.57), (16_000, 512, 3.93), (3_840, 1024, 5.21), (32_640, 1024, 6.46), (7_680, 256, 2.58)],
)
def test_model_matches_the_measured_peaks_from_above_or_within_4_percent(tokens, chunk, measured_gib):
    """Peaks measured on the H200 (docs/benchmarks/learner-throughput.md, torch's max_memory_allocated): the
    model may overestimate (safe) but never underestimate by more than 4%."""
    modelled = learner_peak_bytes(STUDENT, tokens, chunk, checkpointing=True) / GIB
    assert modelled >= measured_gib * 0.96
    assert modelled <= measured_gib * 1.15


def test_the_4_8_gib_share_gets_a_budget_between_the_measured_fit_and_the_measured_oom():
    tokens = fit_tokens(STUDENT, int(4.8 * GIB), 256, checkpointing=True, longest_row=832)
    assert 16_000 <= tokens < 32_640  # 16,000 ran at 3.57 GiB; 32,768 went out of memory under the cap
    assert learner_peak_bytes(STUDENT, tokens, 256, True) <= 4.8 * GIB * 0.85


def test_without_checkpointing_the_budget_shrinks_and_a_tiny_share_is_refused_with_the_arithmetic():
    assert fit_tokens(STUDENT, int(4.8 * GIB), 256, False, 1) < fit_tokens(STUDENT, int(4.8 * GIB), 256, True, 1) / 5
    with pytest.raises(ConfigError) as err:
        fit_tokens(STUDENT, int(1.0 * GIB), 256, True, 832)
    msg = str(err.value)
    assert "cannot hold one row of 832 tokens" in msg and "weights and adapter state take" in msg
    assert "trainer.gradient_checkpointing" in msg


def test_an_explicit_budget_over_the_share_is_refused_with_the_one_that_fits():
    check_token_budget(STUDENT, int(4.8 * GIB), 16_384, 256, True)  # the gkd_4080 recipe's setting
    best = fit_tokens(STUDENT, int(4.8 * GIB), 256, True, 1)
    with pytest.raises(ConfigError, match=rf"use at most {best} tokens, or 0 to size it from the share"):
        check_token_budget(STUDENT, int(4.8 * GIB), 65_536, 256, True)


def test_scorer_budget_grows_with_the_share_and_is_zero_when_the_weights_do_not_fit():
    small, large = scorer_tokens(TEACHER, int(4.8 * GIB), 256), scorer_tokens(TEACHER, int(9.6 * GIB), 256)
    assert 1_000 < small < large
    assert scorer_tokens(TEACHER, int(3.0 * GIB), 256) == 0
    assert scorer_tokens(TEACHER, int(4.8 * GIB), 0) < small  # whole-micro-batch logits cost per token
