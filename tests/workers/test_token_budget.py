"""The learner's micro-batch token budget (workers/token_budget.py): sized from a memory share, lowered after an
out-of-memory update, refused where it cannot shrink. On the CPU with an emulated share."""

from __future__ import annotations

import pytest
import torch

from miniverl.errors import ConfigError, MiniVerlError
from miniverl.models.lora import build_lora_model
from miniverl.models.sizing import fit_tokens
from miniverl.process import ProcessSettings
from miniverl.workers.token_budget import OOM_SHRINK, learner_shape, shrink_after_oom, size_micro_batches
from tests.step.test_controller import LORA

SHARE_GIB = 0.25


@pytest.fixture(scope="module")
def model(random_model_dir):
    return build_lora_model(str(random_model_dir), LORA, torch.float32, "cpu")


def test_the_shape_counts_the_frozen_base_in_bytes_and_the_adapter_in_parameters(model):
    shape = learner_shape(model)
    config = model.get_base_model().config
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert (shape.layers, shape.vocab) == (config.num_hidden_layers, config.vocab_size)
    assert shape.adapter_params == adapter > 0 and shape.weight_bytes == 4 * frozen  # float32


def test_an_unset_budget_is_the_most_the_share_holds_and_is_printed(model, capsys):
    share = ProcessSettings("cpu", gpu_memory_gib=SHARE_GIB)
    tokens = size_micro_batches(model, share, 0, 0, False, 24, closed_form_head=False)
    assert tokens == fit_tokens(learner_shape(model), int(SHARE_GIB * 2**30), 0, False, 24) > 24
    assert f"micro-batches of up to {tokens} tokens" in capsys.readouterr().out


def test_a_compiled_learner_is_sized_for_its_larger_activations(model):
    """The learner passes trainer.compile_layers: compiled layers keep more per token (models/sizing.py), so the same
    share holds fewer tokens, and a budget eager layers hold can be refused for compiled ones."""
    share = ProcessSettings("cpu", gpu_memory_gib=SHARE_GIB)
    eager = size_micro_batches(model, share, 0, 0, False, 24, closed_form_head=False)
    compiled = size_micro_batches(model, share, 0, 0, False, 24, closed_form_head=False, compiled=True)
    assert learner_shape(model, compiled=True).compiled and not learner_shape(model).compiled
    assert 24 < compiled < eager
    assert compiled == fit_tokens(learner_shape(model, True), int(SHARE_GIB * 2**30), 0, False, 24)
    with pytest.raises(ConfigError, match=f"max_tokens_per_micro_batch={eager} would peak"):
        size_micro_batches(model, share, eager, 0, False, 24, closed_form_head=False, compiled=True)


def test_a_set_budget_is_kept_when_it_fits_and_refused_with_the_arithmetic_when_not(model, capsys):
    share = ProcessSettings("cpu", gpu_memory_gib=SHARE_GIB)
    fits = size_micro_batches(model, share, 0, 0, False, 24, closed_form_head=False)
    assert size_micro_batches(model, share, 64, 0, False, 24, closed_form_head=False) == 64
    with pytest.raises(ConfigError, match=f"max_tokens_per_micro_batch={4 * fits} would peak .* at most {fits}"):
        size_micro_batches(model, share, 4 * fits, 0, False, 24, closed_form_head=False)
    tiny = ProcessSettings("cpu", gpu_memory_gib=learner_shape(model).weight_bytes / 2**30)
    with pytest.raises(ConfigError, match="cannot hold one row of 24 tokens"):
        size_micro_batches(model, tiny, 0, 0, False, 24, closed_form_head=False)


def test_an_out_of_memory_update_is_redone_at_oom_shrink_of_the_budget(capsys):
    assert shrink_after_oom(400, 1, 100, "CUDA out of memory", "cpu") == int(400 * OOM_SHRINK) == 300
    assert "redoing this update at 300 tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tokens", "world_size", "longest", "why"),
    [
        (0, 1, 10, "counted in rows"),
        (400, 2, 10, "several ranks"),
        (400, 1, 301, "the longest row has 301 tokens"),
    ],
)
def test_a_budget_that_cannot_shrink_stops_with_the_reason_and_the_fixes(tokens, world_size, longest, why):
    error = "CUDA out of memory. " + "x" * 400
    with pytest.raises(MiniVerlError, match=f"cannot shrink them \\(.*{why}.*num_gpus") as raised:
        shrink_after_oom(tokens, world_size, longest, error, "cpu")
    assert str(raised.value).endswith("CUDA said: " + error[:300])  # CUDA's message, cut short
