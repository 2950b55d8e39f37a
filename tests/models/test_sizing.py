"""The learner's peak-memory model (models/sizing.py): the measured H200 peaks it was calibrated on, the budget
it picks for a share, and the refusals with their arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from miniverl.errors import ConfigError
from miniverl.models.sizing import (
    LearnerShape,
    check_scorer_fits,
    check_token_budget,
    fit_tokens,
    learner_peak_bytes,
    scorer_chunk_entry_bytes,
    scorer_peak_bytes,
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
    [
        (16_384, 512, 3.02),
        (32_768, 512, 4.86),
        (32_768, 1024, 4.86),
        (24_769, 1024, 3.94),
        (22_624, 1024, 3.79),
        (20_072, 256, 3.44),
    ],
)
def test_model_matches_the_measured_peaks_from_above_or_within_4_percent(tokens, chunk, measured_gib):
    """Peaks measured on the H200 with the bf16 LoRA arithmetic and the Triton passes (2026-12-02,
    lab/results/learner-throughput.md: diag10, confirm3, confirm4 and diag9's first cell; torch's
    max_memory_allocated): the model may overestimate (safe) but never underestimate by more than 4%."""
    modelled = learner_peak_bytes(STUDENT, tokens, chunk, checkpointing=True, closed_form=True) / GIB
    assert modelled >= measured_gib * 0.96
    assert modelled <= measured_gib * 1.15


def test_compiled_layers_are_modelled_at_their_measured_peak_and_get_shorter_micro_batches():
    """diag13a (lab/results/learner-throughput.md, H200): at 17,751-token micro-batches the compiled layers
    peaked at 3.71 GiB allocated where eager ones peaked at 3.29. At the 4080 recipe's learner share (4.14 GiB after
    its context) the eager model's 17,322 tokens went out of memory in the first compiled update of every GPU run
    (peers.md run 2, decode-profile.md runs 3 and 8) and 12,991 ran."""
    compiled = dataclasses.replace(STUDENT, compiled=True)
    eager_gib = learner_peak_bytes(STUDENT, 17_751, 1024, True, True) / GIB
    compiled_gib = learner_peak_bytes(compiled, 17_751, 1024, True, True) / GIB
    assert eager_gib == pytest.approx(3.29, rel=0.05)
    assert compiled_gib == pytest.approx(3.71, rel=0.05)
    share = int(4.14 * GIB)
    eager = fit_tokens(STUDENT, share, 1024, checkpointing=True, longest_row=832, closed_form=True)
    shorter = fit_tokens(compiled, share, 1024, checkpointing=True, longest_row=832, closed_form=True)
    assert 12_991 <= shorter < 17_322 <= eager
    # without checkpointing every layer's activations stay: the extra counts in each of them
    assert learner_peak_bytes(compiled, 1_000, 0, False) > learner_peak_bytes(STUDENT, 1_000, 0, False)


def test_the_shares_get_budgets_inside_what_ran():
    """4.8 GiB (the bench's cap): 24,769 tokens ran at 3.94 GiB, 32,768 peaks 4.86 GiB (over the cap). 4.14 GiB
    (the 4080 recipe's learner after its CUDA context): 19,757 tokens went out of memory in the recipe's first
    update (fragmentation after the conformance gate), 15,375 ran (peak 2.99 GiB allocated, 3.42 reserved)."""
    bench = fit_tokens(STUDENT, int(4.8 * GIB), 1024, checkpointing=True, longest_row=640, closed_form=True)
    assert 20_000 <= bench < 32_768
    assert learner_peak_bytes(STUDENT, bench, 1024, True, True) <= 4.8 * GIB * 0.80
    recipe = fit_tokens(STUDENT, int(4.14 * GIB), 1024, checkpointing=True, longest_row=640, closed_form=True)
    assert 15_375 <= recipe < 19_757


def test_autograd_chunks_count_fp32_copies():
    """Full-vocabulary GKD (autograd over each chunk) keeps fp32 copies of the chunk's logits: a 1,024-token
    chunk takes 3.7 GB there and 0.6 GB on the closed-form path, and the budget follows."""
    closed = fit_tokens(STUDENT, int(4.8 * GIB), 256, True, 640, closed_form=True)
    autograd = fit_tokens(STUDENT, int(4.8 * GIB), 256, True, 640, closed_form=False)
    assert closed == autograd  # at 256-token chunks the backward phase is the peak either way
    autograd_peak = learner_peak_bytes(STUDENT, 4096, 1024, True, closed_form=False)
    closed_peak = learner_peak_bytes(STUDENT, 4096, 1024, True, closed_form=True)
    assert 2.5 * GIB < autograd_peak - closed_peak < 3.5 * GIB


def test_without_checkpointing_the_budget_shrinks_and_a_tiny_share_is_refused_with_the_arithmetic():
    assert fit_tokens(STUDENT, int(4.8 * GIB), 256, False, 1) < fit_tokens(STUDENT, int(4.8 * GIB), 256, True, 1) / 5
    with pytest.raises(ConfigError) as err:
        fit_tokens(STUDENT, int(1.0 * GIB), 256, True, 832)
    msg = str(err.value)
    assert "cannot hold one row of 832 tokens" in msg and "weights and adapter state take" in msg
    assert "trainer.gradient_checkpointing" not in msg and "model.student.quantization=nf4" in msg  # on already
    with pytest.raises(ConfigError, match="turn on trainer.gradient_checkpointing") as err:
        fit_tokens(STUDENT, int(1.0 * GIB), 256, False, 832)
    quantized = dataclasses.replace(STUDENT, quantized=True)
    with pytest.raises(ConfigError) as err:
        fit_tokens(quantized, int(1.0 * GIB), 256, True, 832)
    assert "quantize" not in str(err.value)  # the student is 4-bit already: not offered as the fix


def test_an_explicit_budget_over_the_share_is_refused_with_the_one_that_fits():
    check_token_budget(STUDENT, int(4.8 * GIB), 16_384, 256, True)
    best = fit_tokens(STUDENT, int(4.8 * GIB), 256, True, 1)
    with pytest.raises(ConfigError, match=rf"use at most {best} tokens, or 0 to size it from the share"):
        check_token_budget(STUDENT, int(4.8 * GIB), 65_536, 256, True)


@pytest.mark.parametrize(
    "support_k, tokens, measured_gib",
    [(64, 8_080, 3.813), (64, 32_768, 5.364), (None, 8_080, 3.718)],
)
def test_the_scorer_model_is_within_7_percent_above_the_run_9_bench(support_k, tokens, measured_gib):
    """The scorer alone on an H100 (lab/results/decode-profile.md run 9, `python -m lab.bench.scorer_profile`:
    the 1.5B-shape bf16 teacher, 1,024-token chunks, torch's max_memory_allocated): the model overestimates by 2.0%,
    3.7% (top-64) and 6.3% (no support), never under."""
    teacher = dataclasses.replace(TEACHER, weight_bytes=3_087_428_608)  # the 1.5B shape's bf16 weights
    entry = scorer_chunk_entry_bytes(support_k, 1.0, 151_936, kernels=True)
    modelled = scorer_peak_bytes(teacher, tokens, 1024, entry) / GIB
    assert measured_gib <= modelled <= measured_gib * 1.07


def test_scorer_budget_grows_with_the_share_and_is_zero_when_the_weights_do_not_fit():
    small, large = scorer_tokens(TEACHER, int(4.8 * GIB), 256), scorer_tokens(TEACHER, int(9.6 * GIB), 256)
    assert 1_000 < small < large
    assert scorer_tokens(TEACHER, int(3.0 * GIB), 256) == 0
    assert scorer_tokens(TEACHER, int(4.8 * GIB), 0) < small  # whole-micro-batch logits cost per token


@pytest.mark.parametrize(
    "support_k, temperature, kernels, entry",
    [
        (None, 1.0, True, 4),  # sampled-token log-probs only (PG-k1, evaluation): the bf16 logits
        (None, 2.0, True, 4),  # the sampled tokens are scored at temperature 1 whatever the loss's
        (64, 1.0, True, 4),  # top-K + tail straight from the bf16 logits
        (64, 2.0, True, 16),  # another loss temperature: log-softmax in fp32
        (0, 1.0, True, 16),  # full support
        (151_936, 1.0, True, 16),  # K >= V is the full support
        (64, 1.0, False, 16),  # no Triton passes: the torch fallback upcasts
    ],
)
def test_a_scoring_chunk_is_counted_in_the_dtype_its_path_keeps(support_k, temperature, kernels, entry):
    assert scorer_chunk_entry_bytes(support_k, temperature, 151_936, kernels) == entry


def test_the_4080_recipes_teacher_fits_its_share_at_1024_token_chunks_only_when_counted_in_bf16():
    """Run 6 (lab/results/qlora-4080.md): the 1.5B teacher's 0.35 share of 16 GiB less its context, 1,024-token
    chunks, GKD top-64. Counted as fp32 copies nothing fit and the scorer fell back to one row per forward
    (8.5 s of scoring a step); counted as the bf16 logits it keeps, it plans forwards well above the 4,388 tokens
    it ran at before, and the fp32 count is now refused instead of crawling."""
    share = int((0.35 * 16 - 0.66) * GIB)
    bf16 = scorer_chunk_entry_bytes(64, 1.0, TEACHER.vocab, kernels=True)
    assert check_scorer_fits(TEACHER, share, 1024, bf16, 832) > 1.5 * 4_388  # 8,041
    with pytest.raises(ConfigError) as err:
        check_scorer_fits(TEACHER, share, 1024, scorer_chunk_entry_bytes(0, 1.0, TEACHER.vocab, True), 832)
    msg = str(err.value)
    assert "cannot hold one row of 832 tokens" in msg and "1024 tokens x 151936 x 16 B" in msg
    assert "lower trainer.logprob_chunk_tokens" in msg and "resources.scorer.num_gpus" in msg
    assert "model.teacher.quantization=nf4" in msg


def test_a_scorer_without_chunks_is_told_to_set_them_and_a_row_longer_than_the_budget_is_refused():
    share = int(4.8 * GIB)
    fits = scorer_tokens(TEACHER, share, 256, 4)
    assert check_scorer_fits(TEACHER, share, 256, 4, fits) == fits
    with pytest.raises(ConfigError, match=f"one row of {fits + 1} tokens"):
        check_scorer_fits(TEACHER, share, 256, 4, fits + 1)
    with pytest.raises(
        ConfigError, match=r"every token's logits cost .* set trainer.logprob_chunk_tokens \(e.g. 256\)"
    ):
        check_scorer_fits(TEACHER, int(3.6 * GIB), 0, 16, 832)
    with pytest.raises(ConfigError, match="teacher weights alone exceed it") as err:
        check_scorer_fits(TEACHER, int(3.0 * GIB), 256, 4, 832)
    assert "logprob_chunk_tokens" not in str(err.value)  # a smaller chunk cannot help there
