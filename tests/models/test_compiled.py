"""trainer.compile_layers (models/compiled.py): the learner with each decoder layer through torch.compile computes
the same update as eager, with gradient checkpointing and micro-batches of different shapes, without graph breaks,
and keeps the adapter's names; a model without decoder layers is refused."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import weakref
from collections import Counter

import pytest
import torch

from miniverl.errors import ConfigError
from miniverl.models.compiled import compile_decoder_layers
from miniverl.models.loading import load_causal_lm
from miniverl.models.lora import adapter_state
from miniverl.models.packing import batch_micro_batches
from miniverl.workers.learner import LearnerWorker
from tests.objectives.test_objective_invariances import (
    CPU,
    LORA,
    REWARDS,
    assert_same,
    data,  # noqa: F401 (fixture)
    objectives,
    score,
    two_updates,
)


def learner(student_dir, objective, compiled: bool, dtype: str = "float32") -> LearnerWorker:
    torch.manual_seed(0)
    return LearnerWorker(
        str(student_dir),
        LORA,
        dtype,
        objective,
        1e-2,
        0.0,
        1e9,
        2,  # rows per micro-batch: 4 micro-batches of different lengths
        CPU,
        gradient_checkpointing=True,
        compile_layers=compiled,
    )


def profiled_update(worker: LearnerWorker, batch, scores) -> Counter:
    """The op and region names of one more update, counted."""
    from torch.profiler import ProfilerActivity, profile

    worker.publish_policy()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        worker.update(dataclasses.replace(batch, policy_version=worker.version), scores, REWARDS)
    return Counter(e.name for e in prof.events())


@pytest.mark.parametrize("name", ["gkd_top8", "pg_k1"])
def test_compiled_layers_give_the_eager_update_every_micro_batch_compiled(name, data, student_dir):  # noqa: F811
    batch, scorer = data
    objective = objectives()[name]
    scores = score(scorer, objective, batch)
    eager = learner(student_dir, objective, compiled=False)
    compiled = learner(student_dir, objective, compiled=True)
    layers = compiled.model.get_base_model().model.layers
    assert all("forward" in layer.__dict__ and not layer.gradient_checkpointing for layer in layers)
    # transformers >= 5.2x with kernels: the attention's hub-kernel routing wrapper is bypassed (it broke compiling)
    routed = [m for m in layers.modules() if "_kernel_funcs" in m.__dict__]
    assert all(type(m)._unrouted and type(m).forward is type(m).__mro__[1].forward.__wrapped__ for m in routed)
    want = two_updates(eager, batch, scores)
    got = two_updates(compiled, batch, scores)
    # fp32: Inductor's fused arithmetic reorders sums, nothing more
    assert_same(want, got, rtol=1e-4, atol=1e-5)
    assert set(adapter_state(compiled.model)) == set(adapter_state(eager.model))  # published under the same names
    # Every micro-batch's every layer ran as a compiled region: a graph break (RoundedAdapter marking a projection
    # used inside the checkpoint did that) falls back to eager for the whole layer, every call.
    ops, eager_ops = profiled_update(compiled, batch, scores), profiled_update(eager, batch, scores)
    micro_batches = len(batch_micro_batches(batch, 0, 2))
    backwards = ops["CompiledFunctionBackward"]  # one per compiled region that trained (PG-k1's reference: none)
    assert micro_batches > 1 and backwards == micro_batches * len(layers)
    assert ops["aten::mul"] < eager_ops["aten::mul"] / 2  # the elementwise work fused away


def test_no_loaded_model_writes_the_kernel_routing_variable_a_compiling_thread_reads(student_dir, monkeypatch):
    """transformers >= 5.2x wraps the attention so that each call sets kernels' routing variable, process-wide
    while torch.compiler.is_compiling() holds, and torch holds it for the whole process while any thread compiles.
    With trainer.staleness=1 and compiled layers, the rollout thread's eager attention wrote it while the learner's
    thread traced a layer reading it: the compile failed at random (CI, test_main's stale-compiled run). Every model
    load_causal_lm hands over is unwrapped, so none writes it."""
    from transformers import AutoModelForCausalLM

    routing = pytest.importorskip("kernels._internals.layer.layer")._ACTIVE_KERNEL_FUNCS
    as_transformers_loads_it = AutoModelForCausalLM.from_pretrained(str(student_dir))
    if not any("_kernel_funcs" in m.__dict__ for m in as_transformers_loads_it.modules()):
        pytest.skip("this transformers wraps no module for the kernels package")
    loaded = load_causal_lm(str(student_dir), torch.float32, "cpu")
    writes = []
    original = routing.set
    monkeypatch.setattr(routing, "set", lambda value: writes.append(value) or original(value))
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # as while another thread compiles
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        loaded(ids)
        assert writes == [] and not routing.uses_global_var
        as_transformers_loads_it(ids)
    assert writes  # the check can fail: transformers' own model writes the variable on every attention call
    torch.testing.assert_close(loaded(ids).logits, as_transformers_loads_it(ids).logits, rtol=0, atol=0)
    attention = next(m for m in loaded.modules() if "_kernel_funcs" in m.__dict__)
    assert "forward" not in attention.__dict__  # the class swapped: no method on its own module (a reference cycle)
    assert type(pickle.loads(pickle.dumps(attention))) is type(attention)
    gc.collect()
    gc.disable()
    try:
        ref = weakref.ref(attention)
        del attention, loaded
        assert ref() is None  # freed without the collector
    finally:
        gc.enable()


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ConfigError, match="no transformers decoder layers.*compile_layers=false"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_in_bf16_the_compiled_learner_rounds_as_eager_does(data, student_dir):  # noqa: F811
    """Inductor keeps bf16 intermediates in fp32 unless told to round them (emulate_precision_casts): the learner's
    log-probs, which the samplers are held to, stay within a few 1e-3 nats of the eager bf16 ones."""
    batch, scorer = data
    objective = objectives()["gkd_top8"]
    scores = score(scorer, objective, batch)
    workers = []
    for compiled in (False, True):
        worker = learner(student_dir, objective, compiled, dtype="bfloat16")
        worker.publish_policy()
        worker.update(dataclasses.replace(batch, policy_version=0), scores, None)
        workers.append(worker)
    mask = batch.response_mask.bool()
    eager, compiled = (w.policy_logprobs(batch)[mask].float() for w in workers)
    gap = (eager - compiled).abs()
    assert gap.mean() < 2e-3 and gap.max() < 2e-2, (gap.mean(), gap.max())


def test_on_the_cpu_a_fused_kernel_rounds_a_bf16_cast_as_eager_does():
    """RMSNorm's `weight * h.to(bf16)` in one fused CPU kernel: torch 2.11's C++ backend read back the unrounded h
    even under emulate_precision_casts (models/compiled.py, _round_fused_casts_on_cpu); eager rounds it."""
    import torch._dynamo

    from miniverl.models.compiled import _configure_compiler

    def norm(x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(torch.bfloat16)

    _configure_compiler()
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((16, 64), (64,)))
    torch.testing.assert_close(torch.compile(norm, dynamic=False)(x, w), norm(x, w), rtol=0, atol=0)
