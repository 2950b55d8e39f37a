"""The adapter's arithmetic (models/lora.py): every peft LoRA linear layer computes its term with `lora_delta`
in the base's dtype, and hands what it does not cover back to peft."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch

from miniverl.models.lora import LoraSettings, RoundedAdapter, build_lora_model, lora_delta

TARGETS = ("q_proj", "v_proj", "down_proj", "embed_tokens")  # an embedding adapter too: it must keep peft's forward
# peft warns that the tied embedding carries an adapter; here that is the point
pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")


def model_at(student_dir, dtype: torch.dtype, alpha: float):
    """The built-in student with a non-zero adapter (lora_B starts at 0, which would compare the base only)."""
    model = build_lora_model(str(student_dir), LoraSettings(8, alpha, 0.0, TARGETS, 0), dtype, "cpu")
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def adapted(model) -> list:
    return [m for m in model.modules() if hasattr(m, "_peft_forward")]


def test_every_linear_adapter_computes_lora_delta_and_the_embedding_keeps_peft(student_dir):
    model = model_at(student_dir, torch.bfloat16, alpha=16.0)
    layers = adapted(model)
    assert len(layers) == 3 * 2  # q, v, down in each of the two layers; the embedding adapter is peft's own
    assert not hasattr(model.get_base_model().model.embed_tokens, "_peft_forward")
    layer = layers[0]
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    assert a.dtype == torch.float32  # the masters stay fp32
    want = layer.base_layer(x) + lora_delta(x, a, b, s)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(got, layer._peft_forward(x))  # peft's fp32 arithmetic is another function in bf16


@pytest.mark.parametrize("alpha", [16.0, 12.0])
def test_in_fp32_it_is_peft_up_to_where_the_scaling_is_applied(student_dir, alpha):
    """alpha / r = 2 is a power of two: folding it into B changes no bit; 1.5 is not: fp32 rounding only."""
    model = model_at(student_dir, torch.float32, alpha=alpha)
    ids = torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(3))
    ours = model(input_ids=ids).logits
    for layer in adapted(model):
        layer.__class__ = type(layer).__mro__[1]  # peft's own class and forward
    theirs = model(input_ids=ids).logits
    if alpha / 8 == 2.0:
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_disabled_merged_biased_or_called_with_keywords_goes_to_peft(student_dir, monkeypatch):
    model = model_at(student_dir, torch.float32, alpha=16.0)
    ids = torch.randint(0, 20, (1, 6), generator=torch.Generator().manual_seed(4))
    with model.disable_adapter():
        base = model(input_ids=ids).logits
    with model.disable_adapter(), torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base)  # no recursion, no adapter term
    layer = adapted(model)[0]
    calls = []
    peft_forward = type(layer)._peft_forward
    monkeypatch.setattr(type(layer), "_peft_forward", lambda self, x, *a, **k: calls.append(k) or peft_forward(self, x))
    x = torch.randn(2, layer.in_features)
    layer(x)
    assert calls == []  # the plain case is ours
    layer(x, adapter_names=["default", "default"])
    layer.lora_bias["default"] = True
    layer(x)
    layer.lora_bias["default"] = False
    layer.merge()
    layer(x)
    assert len(calls) == 3


def test_the_swapped_class_pickles_is_never_swapped_twice_and_frees_without_the_collector(student_dir):
    from miniverl.models import lora

    model = model_at(student_dir, torch.float32, alpha=16.0)
    layer = adapted(model)[0]
    cls = type(layer)
    assert not lora._plain_lora_linear(layer)  # already swapped: a second build step leaves it alone
    restored = pickle.loads(pickle.dumps(layer))
    assert type(restored) is cls
    x = torch.randn(2, layer.in_features)
    assert torch.equal(restored(x), layer(x))
    gc.collect()
    gc.disable()
    try:
        ref = weakref.ref(layer)
        del layer, restored, model
        assert ref() is None  # no reference cycle keeps a discarded model (and its GPU memory) alive
    finally:
        gc.enable()


def adapter_grads(model) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters() if "lora_" in n}


def micro_batch_gradients(model, rounded: bool, chunks=3) -> tuple[dict, list]:
    """The adapter's gradients over `chunks` micro-batches, with the adapter rounded once or per call."""
    model.zero_grad(set_to_none=True)
    model.train()
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 20, (2, 6), generator=gen) for _ in range(chunks)]
    outputs = []

    def run(scope=None):
        for ids in batches:
            logits = model(input_ids=ids).logits
            outputs.append(logits.detach())
            logits.float().logsumexp(-1).sum().backward()
            if scope is not None:
                scope.collect()

    if rounded:
        with RoundedAdapter(model) as scope:
            run(scope)
            # every adapted projection took the rounded copies (else this compares lora_delta with itself)
            assert all(layer.__dict__["_rounded"]["default"].used for layer in adapted(model))
    else:
        run()
    return adapter_grads(model), outputs


@pytest.mark.parametrize(
    "dtype, checkpointing", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)]
)
def test_rounding_the_adapter_once_per_step_changes_no_bit_of_the_outputs_or_the_gradients(
    student_dir, dtype, checkpointing
):
    """RoundedAdapter against lora_delta's per-call rounding: the same forward, and the same fp32 gradients
    accumulated over several micro-batches (float(g), times s for B, then added), with one layer at another
    scaling (alpha / r = 1.5: not a power of two) so the scaling really multiplies; also under the learner's
    non-reentrant gradient checkpointing (the recomputation reuses the rounded copies)."""
    model = model_at(student_dir, dtype, alpha=16.0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = adapted(model)
    layers[1].scaling["default"] = 1.5
    want, want_out = micro_batch_gradients(model, rounded=False)
    got, got_out = micro_batch_gradients(model, rounded=True)
    assert all(torch.equal(a, b) for a, b in zip(want_out, got_out, strict=True))
    assert want.keys() == got.keys()
    for name in want:
        assert (want[name] is None) == (got[name] is None), name
        if want[name] is not None:
            assert got[name].dtype == torch.float32
            assert torch.equal(want[name], got[name]), name
    assert any("embed_tokens" in n and g is not None for n, g in got.items())  # peft's own adapter: autograd as ever
    assert not any("_rounded" in layer.__dict__ for layer in layers)  # nothing left on the modules


def test_a_projection_no_forward_reached_keeps_no_gradient_and_an_error_assigns_none(student_dir):
    model = model_at(student_dir, torch.bfloat16, alpha=16.0)
    first, second = adapted(model)[:2]
    x = torch.randn(3, first.in_features, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with RoundedAdapter(model) as scope:
        first(x).float().sum().backward()
        scope.collect()
    assert first.lora_A["default"].weight.grad is not None and first.lora_B["default"].weight.grad is not None
    assert second.lora_A["default"].weight.grad is None and second.lora_B["default"].weight.grad is None
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="out of memory"), RoundedAdapter(model) as scope:
        first(x).float().sum().backward()
        scope.collect()
        raise RuntimeError("CUDA out of memory (stand-in)")
    assert first.lora_A["default"].weight.grad is None  # the learner redoes the step from nothing
    assert "_rounded" not in first.__dict__
    with model.disable_adapter(), RoundedAdapter(model):  # a disabled adapter still goes to peft, inside too
        assert torch.equal(first(x), first.base_layer(x))


def test_a_backward_left_uncollected_is_added_at_exit_and_a_no_grad_forward_adds_no_gradient(student_dir):
    model = model_at(student_dir, torch.bfloat16, alpha=16.0)
    first, second = adapted(model)[:2]
    x = torch.randn(3, first.in_features, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    first(x).float().sum().backward()
    want = first.lora_A["default"].weight.grad.clone()
    model.zero_grad(set_to_none=True)
    with RoundedAdapter(model):
        first(x).float().sum().backward()  # no collect(): the scope's exit adds it
        with torch.no_grad():
            second(x)
    assert torch.equal(first.lora_A["default"].weight.grad, want)
    assert second.lora_A["default"].weight.grad is None  # used without grad: no zero gradient for AdamW to move


def test_building_the_adapter_prints_no_deprecation_of_what_peft_reads(student_dir):
    """peft reads `is_gradient_checkpointing`, which transformers 5.25 deprecates (naming `is_activation_checkpointing`)
    with a FutureWarning every actor printed at start; the project wraps peft without it and keeps every other
    warning. Where transformers has the successor, peft alone does print it (the filter is needed, not idle)."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from miniverl.models.lora import PEFT_DEPRECATION, adapter_template

    def deprecations(build) -> list:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
            warnings.warn("a warning of the caller's own", FutureWarning, stacklevel=1)
        assert [w for w in caught if "of the caller's own" in str(w.message)]  # every filter ends with its call
        return [w for w in caught if PEFT_DEPRECATION in str(w.message)]

    settings = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj",), init_seed=0)
    assert not deprecations(lambda: build_lora_model(str(student_dir), settings, torch.float32, "cpu"))
    assert not deprecations(lambda: adapter_template(str(student_dir), settings, torch.float32))
    if hasattr(PreTrainedModel, "is_activation_checkpointing"):
        base = AutoModelForCausalLM.from_pretrained(str(student_dir))
        assert deprecations(lambda: get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])))
