"""trainer.compile_layers: each decoder layer of the learner's student through torch.compile.

The learner's update is bound by its kernel launches and Python, not by the GPU's arithmetic: about 300 kernels per
decoder layer and micro-batch, 0.3 s per micro-batch at 8.7k and 17.3k tokens alike on an H200
(lab/results/learner-throughput.md, qlora-4080.md, 2026-12-02). Inductor fuses a layer's elementwise work (the norms,
the rotary embedding, SiLU, the LoRA sums) into a few kernels and runs the rest from generated code. On the CPU, at
a tiny shape, a layer's launching ops per micro-batch (forward, recomputation, backward) fell from 244 to 117; the
matmuls (about 75) stay. On an H200 (torch 2.11) it pays: 66.1k trained tokens/s against eager's 39.4k in the same
run at the 12 GiB layout's 4.2 GiB share (learner-throughput.md, 2026-12-03, efc4eff), update 1.97 s against 3.71 in
that recipe (qlora-4080.md, 2026-12-02 and 2026-12-03); +experiment=gkd_4080_12g turns it on, elsewhere it stays opt-in.

How: each layer's forward becomes a compiled function that calls the layer's own forward, under a non-reentrant
checkpoint of its own when the model had gradient checkpointing on, and transformers' checkpointing of that layer is
turned off (transformers 5.17, the GPU machine's, checkpoints in the layer's `__call__`, outside anything compiled
here: it would run the compiled forward twice and lose most of the gain; later releases checkpoint inside `forward`;
the checkpoint here is the same in both). The layers stay where they are, so the adapter's parameter names
(publishing, checkpoints) do not change; `torch.compile(layer)` would rename them. Shapes are dynamic: micro-batches
of any [rows, length] share one graph (a one-row micro-batch compiles its own variant: dynamo specializes sizes 0
and 1; models/packing.py plan_micro_batches keeps a trailing row from going alone where it can). `fullgraph=True`:
a graph break is an error, not a silent fall-back to eager.

What it changes besides speed: Inductor keeps bf16 intermediates in fp32 unless told otherwise; here it rounds them
as eager bf16 does (`emulate_precision_casts`), so the learner's log-probs stay within about 1e-3 nats of the eager
path the rollout's samplers are checked against. The first update compiles (tens of seconds).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from miniverl.errors import ConfigError
from miniverl.models.loading import unwrap_kernel_routing

# No-grad calls (evaluation, probes, the sampler-gap check), the adapter disabled (the reference policy), train and
# eval mode, a one-row micro-batch each add a compiled variant of the one function every layer shares (5 at the 0.5B
# depth over a few updates, measured on the CPU); dynamo's default limit is 8.
RECOMPILE_LIMIT = 64


def compile_decoder_layers(model) -> int:
    """Compile every decoder layer of `model` in place (see the module docstring); returns how many.

    Call it after gradient checkpointing is set. Raises ConfigError when the model has no transformers decoder
    layers (GradientCheckpointingLayer) to compile."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ConfigError(
            f"trainer.compile_layers=true, but the student ({type(model).__name__}) has no transformers decoder"
            " layers to compile; set trainer.compile_layers=false"
        )
    _configure_compiler()

    def compiled_forward(layer: torch.nn.Module, checkpointed: bool):
        own = type(layer).forward.__get__(layer)  # with the layer's checkpointing off, the plain forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if checkpointed and layer.training and torch.is_grad_enabled():
                return checkpoint(partial(own, **kwargs), *args, use_reentrant=False)
            return own(*args, **kwargs)

        return torch.compile(forward, dynamic=True, fullgraph=True)

    for layer in layers:
        checkpointed = bool(layer.gradient_checkpointing)
        layer.gradient_checkpointing = False
        unwrap_kernel_routing(layer)  # loaded models are unwrapped already; a model built in memory may not be
        # An instance attribute that refers to its module: a reference cycle, freed by the garbage collector
        # rather than at once (the learner keeps its model for its process's life).
        layer.forward = compiled_forward(layer, checkpointed)
    return len(layers)


def _configure_compiler() -> None:
    """Process-wide compiler settings the compiled layers rely on."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor
    import torch.fx.experimental._config as fx

    if hasattr(inductor, "emulate_precision_casts"):
        inductor.emulate_precision_casts = True  # round bf16 intermediates as eager does
        _round_fused_casts_on_cpu()
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # the older name
    setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILE_LIMIT))
    if hasattr(fx, "use_duck_shape"):
        # duck sizing equates symbols of equal value: a row length equal to another dimension forced a recompile
        fx.use_duck_shape = False


# Marks what this process's compiled code was generated with (torch.compiler.config.cache_key_tag): Inductor's
# on-disk caches must not hand back CPU kernels generated without _round_fused_casts_on_cpu.
CACHE_TAG = "miniverl-cpu-rounds-fused-casts"


def _round_fused_casts_on_cpu() -> None:
    """Make Inductor's CPU (C++) backend honour emulate_precision_casts as its GPU backend does.

    In torch 2.11 (2.12 not checked) the C++ backend, on casting an fp32 value to bf16 inside a fused kernel,
    records in its CSE cache that casting the bf16 result back to fp32 gives the original fp32 value (pytorch#115260);
    a later op in the same kernel then reads the unrounded value, whatever emulate_precision_casts says: RMSNorm's
    `weight * h.to(bf16)` multiplies by the unrounded h. torch 2.13 skips that shortcut under emulate_precision_casts
    (pytorch#185337); this does the same on older releases (and changes nothing on 2.13, which no longer calls it
    then)."""
    import torch._inductor.config as inductor
    import torch.compiler.config as compiler

    try:
        from torch._inductor.codegen.cpp import CppKernel
    except ImportError:  # pragma: no cover - a torch without the C++ backend
        return
    original = CppKernel.cache_dtype_convert
    if getattr(original, "_miniverl_rounds", False):
        return

    def cache_dtype_convert(self, *args: Any, **kwargs: Any) -> None:
        if not inductor.emulate_precision_casts:
            original(self, *args, **kwargs)

    cache_dtype_convert._miniverl_rounds = True  # type: ignore[attr-defined]
    CppKernel.cache_dtype_convert = cache_dtype_convert
    if CACHE_TAG not in compiler.cache_key_tag:
        compiler.cache_key_tag = f"{compiler.cache_key_tag}+{CACHE_TAG}" if compiler.cache_key_tag else CACHE_TAG
