"""The student with a LoRA adapter (peft), built the same way by the learner and the HF rollout backends; the
adapter's layers and size read from a model built on the meta device (the pre-flight checks and the fit planner)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miniverl.models.loading import load_causal_lm, picklable_subclass


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    init_seed: int

    @classmethod
    def from_config(cls, cfg) -> LoraSettings:
        """Built from the `model.lora` config section (the builder; the rest takes plain values)."""
        return cls(cfg.rank, cfg.alpha, cfg.dropout, tuple(cfg.target_modules), cfg.init_seed)


def meta_linear_layers(config) -> list[tuple[str, object]]:
    """(last name component, module) of every linear layer of the model of transformers `config`, built on the meta
    device: no weights are read or allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name.rsplit(".", 1)[-1], m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def adapter_params(config, rank: int, target_modules) -> int:
    """Parameters of the LoRA adapter peft would put on the model of transformers `config`: rank x (in + out) for every
    linear layer whose last name component is in `target_modules`, counted on the meta device (no weights)."""
    targets = set(target_modules)
    return sum(rank * (m.in_features + m.out_features) for name, m in meta_linear_layers(config) if name in targets)


# peft 0.21's PeftModel reads the model's `is_gradient_checkpointing`, which transformers 5.25 deprecated (a
# FutureWarning naming its successor in every actor's log at start): peft's to change, nothing a user can act on.
PEFT_DEPRECATION = "`is_gradient_checkpointing` is deprecated"


def wrap_with_adapter(model, config):
    """peft's get_peft_model(model, config), without transformers' deprecation warning about what peft reads."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_DEPRECATION, category=FutureWarning)
        return get_peft_model(model, config)


def build_lora_model(path: str, lora: LoraSettings, dtype: torch.dtype, device: str, quantization: str = "none"):
    """Base model from `path` wrapped with a fresh adapter; lora_B starts at 0, so it serves the base.

    The adapter's weights are fp32 (peft's default over a bf16 base: the optimizer's master weights), but every
    adapted projection computes its LoRA term in the base's dtype (`lora_delta`), as hf_cached and vLLM serve it.

    `quantization` nf4 gives a QLoRA student: the base is 4-bit (models/loading.py), the adapter is not.
    peft's prepare_model_for_kbit_training is deliberately not called: it casts every bf16 non-quantized
    weight (embeddings, norms, LM head) to fp32, which at a 152k vocabulary adds 0.27 GB for the embedding
    alone on a 16 GB card; what it does besides is freezing the base (get_peft_model does that) and making
    inputs require grad for reentrant checkpointing (the learner uses the non-reentrant kind).
    """
    from peft import LoraConfig

    base = load_causal_lm(path, dtype, device, quantization)
    torch.manual_seed(lora.init_seed)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = wrap_with_adapter(base, config)
    for module in model.modules():
        if _plain_lora_linear(module):
            module.__class__ = _computing_in_base_dtype(type(module))
    return model


def lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The LoRA term of one projection as miniVERL computes it everywhere (learner, hf_reference, hf_cached):
    `(x A^T)(s B)^T` in x's dtype, the adapter's weights (fp32 masters) rounded to that dtype once per call, the
    scaling folded into B before the rounding.

    peft's own arithmetic casts x up to the adapter's fp32 instead: on a bf16 base that made the learner's LoRA
    matmuls fp32 GEMMs and added an fp32 copy of every adapted projection's input and output, forward and
    backward (0.8 s of fp32 GEMMs and 1.0 s of casts in a 5.1 s update: lab/results/learner-throughput.md).
    vLLM serves bf16(s B) too. Shapes: x [..., E], lora_a [r, E], lora_b [O, r] -> [..., O] in x's dtype.
    """
    return F.linear(F.linear(x, lora_a.to(x.dtype)), (lora_b * scaling).to(x.dtype))


def _plain_lora_linear(module) -> bool:
    """A peft LoRA layer over a linear base (dense, or bitsandbytes' 4/8-bit layers, which subclass nn.Linear),
    whose forward `_forward` replaces; embedding and convolution adapters keep peft's."""
    from peft.tuners.lora import LoraLayer

    linear_base = isinstance(getattr(module, "base_layer", None), torch.nn.Linear)
    return isinstance(module, LoraLayer) and linear_base and not hasattr(module, "_peft_forward")  # not swapped twice


@functools.cache
def _computing_in_base_dtype(peft_class: type) -> type:
    """`peft_class` with `_forward` as its forward, and peft's kept as `_peft_forward`. A class swap rather than
    a bound method on each instance: a method stored on its own module is a reference cycle, which kept every
    discarded learner's model on the GPU until the garbage collector ran (0.74 GiB per bench cell, measured)."""
    return picklable_subclass(
        peft_class, "BaseDtype", {"forward": _forward, "_peft_forward": peft_class.forward}, __name__
    )


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft LoRA linear layer's forward with the adapter's term from `lora_delta`; what it does not cover
    (adapter disabled or merged, per-row adapters or any other keyword peft reads, DoRA-like variants, a LoRA
    bias) goes to peft's own forward."""
    variants, biased = getattr(self, "lora_variant", {}), getattr(self, "lora_bias", {})
    if self.disable_adapters or self.merged or args or kwargs:
        return self._peft_forward(x, *args, **kwargs)
    if any(name in variants or biased.get(name) for name in self.active_adapters):
        return self._peft_forward(x, *args, **kwargs)
    result = self.base_layer(x)
    rounded = self.__dict__.get("_rounded")  # {adapter: _Rounded} inside a RoundedAdapter scope
    for name in self.active_adapters:
        if name in self.lora_A:
            dropped = self.lora_dropout[name](x)
            once = None if rounded is None else rounded.get(name)
            if once is not None and once.a.dtype == dropped.dtype:
                # a no-grad forward leaves the gradient None, as without the scope. Written once: inside a compiled
                # layer's checkpoint dynamo refuses the write (a graph break), so there RoundedAdapter(all_used=True)
                # has marked every projection already
                if not once.used:
                    once.used = torch.is_grad_enabled()
                result = result + F.linear(F.linear(dropped, once.a), once.sb)  # lora_delta, rounded beforehand
                continue
            result = result + lora_delta(
                dropped, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
            )
    return result


@dataclass
class _Rounded:
    """One adapted projection's A and s*B in the base's dtype: leaves that collect the step's gradients."""

    a: torch.Tensor  # [r, E]
    sb: torch.Tensor  # [O, r]
    used: bool = False


class RoundedAdapter:
    """Inside `with RoundedAdapter(model):` every adapted projection computes `lora_delta` from A and s*B rounded to
    the base's dtype once, on entry, instead of once per call: the rounding and the scaling left the graph, forward
    and backward (with gradient checkpointing each micro-batch's forward runs twice). At the 0.5B shape, r32 on
    every linear layer and 7 micro-batches an update, that is about 4k dtype copies, 2k multiplications and 3k
    backward nodes of an update's 48k kernel launches, counted from the shapes (the learner bench's profile of
    2026-12-02, lab/results/learner-throughput.md: the update is partly CPU-bound). The rounded copies are leaves, so a
    backward leaves their gradients in bf16; `collect()` after each backward adds them to the fp32 masters'
    gradients exactly as autograd did through the cast (float(g), times s for B: the same roundings, bit for bit),
    through flat buffers with a few kernels. Only for a scope in which the masters do not change (one optimizer
    step's micro-batches), with one forward of each projection per backward (the learner's micro-batches; the
    recomputation under gradient checkpointing reuses that forward's graph): a projection run twice before one
    backward gets its two gradients summed in bf16, where the per-call path sums them in fp32. Costs 4 bytes per
    adapter parameter while open (the bf16 copies and their gradients).

    `all_used`: every adapted projection counts as reached (its master gets a gradient, zero if no forward reached
    it), for a scope whose forwards run under grad through every layer (the learner's micro-batches) and may be
    compiled (models/compiled.py), where a forward cannot mark itself."""

    def __init__(self, model, all_used: bool = False) -> None:
        self.all_used = all_used
        self.slots: list[tuple[torch.nn.Module, str]] = []
        for module in model.modules():
            if "_peft_forward" not in type(module).__dict__:
                continue
            for name in module.active_adapters:
                if name in module.lora_A:
                    self.slots.append((module, name))

    def __enter__(self) -> RoundedAdapter:
        masters_a = [m.lora_A[n].weight for m, n in self.slots]
        masters_b = [m.lora_B[n].weight for m, n in self.slots]
        self.scales = [float(m.scaling[n]) for m, n in self.slots]
        self.scale = self.scales[0] if len(set(self.scales)) == 1 else None  # one for every B, as usually
        self.masters = masters_a + masters_b
        dtype = self._base_dtype()
        with torch.no_grad():
            scaled = [b * scale for b, scale in zip(masters_b, self.scales, strict=True)]
            # each lora_delta's own rounding; a copy even where the dtype matches (fp32): never the master itself
            copies = [t.to(dtype, copy=True) for t in masters_a + scaled]
        sizes = [t.numel() for t in copies]
        device = copies[0].device if copies else "cpu"
        # the copies' gradients accumulate in place into one bf16 buffer: each backward adds to zeros, exactly
        self.flat_grad = torch.zeros(sum(sizes), dtype=dtype, device=device)
        self.leaves, self.grad_views = [], []
        for t, g in zip(copies, self.flat_grad.split(sizes), strict=True):
            t.requires_grad_(True)
            t.grad = g.view_as(t)
            self.leaves.append(t)
            self.grad_views.append(t.grad)
        self.sizes = sizes
        self.master_grad = None  # fp32 [sum(sizes)], the masters' .grad are views of it
        half = len(self.slots)
        for (module, name), a, sb in zip(self.slots, self.leaves[:half], self.leaves[half:], strict=True):
            module.__dict__.setdefault("_rounded", {})[name] = _Rounded(a, sb, used=self.all_used)
        return self

    def _base_dtype(self) -> torch.dtype:
        """The dtype the projections' inputs arrive in: the base weights', a 4-bit base's compute dtype. A call
        whose input has another dtype computes lora_delta as usual (its gradient reaches the master directly)."""
        if not self.slots:
            return torch.float32
        from miniverl.models.loading import NF4_COMPUTE_DTYPE

        base = self.slots[0][0].base_layer
        weight = getattr(base, "weight", None)
        if weight is not None and weight.is_floating_point():
            return weight.dtype
        return getattr(base, "compute_dtype", None) or NF4_COMPUTE_DTYPE

    def collect(self) -> None:
        """Add the last backward's gradients of the rounded copies to the masters' (in fp32) and zero them."""
        if not self.slots:
            return
        for leaf, view in zip(self.leaves, self.grad_views, strict=True):
            if leaf.grad is not view:  # autograd accumulates into a defined .grad in place; never lose a gradient
                raise RuntimeError("a rounded adapter copy's gradient left its buffer: collect() cannot see it")
        if self.master_grad is None:
            self.master_grad = torch.zeros(self.flat_grad.shape, dtype=torch.float32, device=self.flat_grad.device)
        half = sum(self.sizes[: len(self.slots)])  # A's entries first, then s*B's
        grad = self.flat_grad.float()
        if self.scale is not None:
            grad[half:] *= self.scale
        else:
            for g, s in zip(grad[half:].split(self.sizes[len(self.slots) :]), self.scales, strict=True):
                g *= s
        self.master_grad += grad
        self.flat_grad.zero_()

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.slots and bool(self.flat_grad.any()):
            self.collect()  # a backward not yet collected is added, not dropped
        used = [False] * len(self.slots)
        for i, (module, name) in enumerate(self.slots):
            used[i] = module.__dict__["_rounded"].pop(name).used
            if not module.__dict__["_rounded"]:
                del module.__dict__["_rounded"]
        if exc[0] is None and self.master_grad is not None:
            views = self.master_grad.split(self.sizes)
            for i, (master, view) in enumerate(zip(self.masters, views, strict=True)):
                if not used[i % len(self.slots)]:
                    continue  # a projection no forward reached keeps no gradient, as without this scope
                view = view.view_as(master)
                if master.grad is None:
                    master.grad = view
                else:
                    master.grad += view
        self.leaves, self.grad_views, self.flat_grad, self.master_grad = [], [], None, None


def live_adapter(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's portable names, where they live (the model's own storage: no copy)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's portable names, copied to the CPU."""
    return {k: v.to("cpu", copy=True) for k, v in live_adapter(model).items()}


def check_adapter_names(expected, given, partial: bool = False) -> None:
    """Refuse adapter tensors whose names are not the model's (`expected`): one the model lacks, or (unless
    `partial`) one of the model's left out. A name that matches nothing is an error, not a no-op."""
    missing, extra = sorted(set(expected) - set(given))[:3], sorted(set(given) - set(expected))[:3]
    if extra or (missing and not partial):
        raise ValueError(
            f"adapter names do not match the model's (missing {missing}, unexpected {extra});"
            " learner and rollout must use the same model.lora settings"
        )


def load_adapter_state(model, weights: dict[str, torch.Tensor]) -> None:
    """Load `weights` into the model's adapter (check_adapter_names first)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    check_adapter_names(get_peft_model_state_dict(model), weights)  # names only: no copy off the device
    set_peft_model_state_dict(model, weights)


def adapter_template(model_dir: str, lora: LoraSettings, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A zero adapter under the learner's peft names and shapes, built on the meta device (no weights read)."""
    from peft import LoraConfig, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        peft = wrap_with_adapter(
            model,
            LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), bias="none"),
        )
    return {k: torch.zeros(v.shape, dtype=dtype) for k, v in get_peft_model_state_dict(peft).items()}
