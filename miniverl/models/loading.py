"""Resolve model references (built-in, local directory, hub id) and load models and tokenizers.

`builtin:teacher` and `builtin:student` name the embedded default models (built and cached on first
use); anything else goes through the same `from_pretrained` path a user's checkpoint takes.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from miniverl.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "nf4")  # model.<role>.quantization
# NF4 matmuls dequantize to this dtype. bf16, as the measured NF4 learner and vLLM's bitsandbytes
# engine used (DESIGN.md: 0.10 nats mean gap between them with double quantization).
NF4_COMPUTE_DTYPE = torch.bfloat16


def nf4_config():
    """bitsandbytes 4-bit NF4 with double quantization (the quantization constants quantized too, ~0.4 bit
    per weight saved), bf16 compute: the base the learner, the teacher and vLLM's engine must all share."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=NF4_COMPUTE_DTYPE,
    )


def require_quantization(quantization: str, device: str, field: str) -> None:
    """Fail before any actor starts when `quantization` cannot load here, saying what to change or install."""
    import importlib.util

    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"{field}={quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return
    if device != "cuda":
        raise ConfigError(
            f"{field}={quantization} loads a bitsandbytes 4-bit model, which needs a CUDA GPU, but this run"
            f" computes on the CPU; set {field}=none (or run on a GPU)"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"{field}={quantization} needs bitsandbytes, which is not installed; pip install 'bitsandbytes>=0.45'"
            f" (a miniverl dependency: pip install -e .), or set {field}=none"
        )


def checkpoint_numel(model_dir: str) -> int:
    """Elements of every tensor in the model directory's *.safetensors files, read from their headers (no weights
    loaded); 0 when it has none (a hub id, or .bin weights)."""
    from safetensors import safe_open

    numel = 0
    for f in sorted(Path(model_dir).expanduser().glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                n = 1
                for d in h.get_slice(key).get_shape():
                    n *= d
                numel += n
    return numel


# bitsandbytes NF4 with double quantization: 4-bit codes, one 8-bit absmax per block of 64, one fp32 constant per
# 256 of those blocks. An estimate (the fit planner's and vLLM's rollout check's), not measured per model.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)


@dataclass(frozen=True)
class ModelSize:
    """A model's size without its weights: every parameter, the ones NF4 quantizes (the decoder's linear layers,
    not the LM head), and its transformers config. The fit planner and vLLM's memory check both size weights here."""

    numel: int
    linear_numel: int
    config: object

    def weight_bytes(self, quantization: str, dtype_bytes: int) -> int:
        if quantization == "nf4":
            return int(self.linear_numel * NF4_BYTES_PER_PARAM + (self.numel - self.linear_numel) * 2)
        return self.numel * dtype_bytes


def model_size(path: str, config) -> ModelSize:
    """The model at `path` (its transformers `config`): parameters from the safetensors headers where there are
    any, else counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"
    )
    numel = checkpoint_numel(path) or sum(p.numel() for p in model.parameters())
    return ModelSize(numel, linear, config)


def torch_dtype(name: str, device: str) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 on the CPU (CPU bf16 matmuls are slow and imprecise)."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_tokenizer(path: str, field: str = "model path", fix: str = "pass a saved model directory"):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser()) if Path(path).expanduser().exists() else path)
    except Exception as e:  # keep the library's reason: a bad tokenizer.json and a missing file need different fixes
        raise ConfigError(f"cannot load a tokenizer from {field}={path!r} ({e.__class__.__name__}: {e}); {fix}") from e


def load_model_config(path: str, field: str, fix: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ConfigError(
            f"cannot read the model config of {field}={path!r} ({e.__class__.__name__}: {e}); {fix}"
        ) from e


def load_causal_lm(path: str, dtype: torch.dtype, device: str, quantization: str = "none"):
    """The model at `path` on `device`; `quantization` nf4 loads it 4-bit (non-quantized parts in `dtype`).

    A bitsandbytes 4-bit model is placed by `device_map` while loading: it refuses `.to(device)`.
    """
    from transformers import AutoModelForCausalLM

    require_quantization(quantization, device, "quantization")
    local = Path(path).expanduser()
    kwargs = {}
    if quantization == "nf4":
        kwargs = {"quantization_config": nf4_config(), "device_map": {"": torch.cuda.current_device()}}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(local) if local.exists() else path, dtype=dtype, **kwargs)
    except Exception as e:
        raise ConfigError(
            f"cannot load the model at {path!r} ({e.__class__.__name__}: {e}); re-save it (save_pretrained) or,"
            " for a built-in model, delete that directory so it is rebuilt"
        ) from e
    unwrap_kernel_routing(model)
    return model if quantization == "nf4" else model.to(device)


def unwrap_kernel_routing(model: torch.nn.Module) -> None:
    """Give the submodules of `model` whose class the `kernels` package wrapped their own forward back.

    transformers >= 5.2x marks the attention `use_kernelized_func(apply_rotary_pos_emb)` whatever USE_HUB_KERNELS
    says (kernels 0.19). The wrapper sets a variable around every call to route hub kernels, and that variable turns
    process-wide while `torch.compiler.is_compiling()` holds, a flag torch sets for the whole process while any
    thread compiles. Left wrapped: dynamo refused the side effect inside a compiled layer's checkpoint (every
    compiled update failed), and with trainer.staleness=1 beside compiled layers (trainer.compile_layers) the rollout
    thread's eager attention wrote that variable while the learner's thread traced a layer that reads it, so the
    compile failed at random (dynamo: "divergence" in its speculation log, kernels' layer.py). Every model is
    unwrapped where it is loaded, so no thread writes it. No hub kernel is ever installed here (nothing calls
    kernels.kernelize): the wrapper routes to the torch function the unwrapped forward calls anyway, so the
    arithmetic is the same."""
    for module in model.modules():
        routed = "_kernel_funcs" in module.__dict__  # kernels' per-instance routing table
        if routed and not getattr(type(module), "_unrouted", False) and hasattr(type(module).forward, "__wrapped__"):
            module.__class__ = _unrouted(type(module))


@functools.cache
def _unrouted(wrapped: type) -> type:
    """`wrapped` with the forward that kernels' decorator wraps, unwrapped. A class swap rather than a bound method
    on each instance: a method stored on its own module is a reference cycle, which keeps a discarded model (and its
    GPU memory) until the garbage collector runs."""
    return picklable_subclass(
        wrapped, "Unrouted", {"forward": wrapped.forward.__wrapped__, "_unrouted": True}, __name__
    )


def picklable_subclass(base: type, prefix: str, members: dict, home: str) -> type:
    """A subclass of `base` named `prefix + base.__name__` (with a `_` added while the name is taken), holding
    `members`, registered by that name in the module `home`, so that a model holding an instance still pickles.
    For swapping a module's class in place (`module.__class__ = ...`), which is how this package changes a loaded
    module's forward without a reference cycle (unwrap_kernel_routing; models/lora.py's LoRA layers): cache the
    caller per `base`, so each class is made once."""
    namespace = vars(sys.modules[home])
    name = f"{prefix}{base.__name__}"
    while name in namespace:  # another base class of the same name
        name += "_"
    swapped = type(name, (base,), {**members, "__module__": home, "__qualname__": name})
    namespace[name] = swapped
    return swapped


def shared_vocab_size(student_logits: int, teacher_logits: int, tokenizer_size: int) -> int:
    """How many logits distillation compares: the student's, when the teacher has at least as many.

    Models of one family pad their output layer past the tokenizer differently (Qwen2.5-0.5B/1.5B/3B:
    151,936 logits, 7B: 152,064, tokenizer: 151,665). Ids past the tokenizer are never real tokens, so
    the scorer drops the teacher's logits past the student's range and renormalizes over the rest. A
    teacher with fewer logits than the student could not score the student's extra ids: refused.
    """
    if teacher_logits < student_logits:
        raise ConfigError(
            f"the teacher outputs {teacher_logits} logits and the student {student_logits}: the teacher cannot"
            " score the student's extra ids; pick a teacher whose output layer is at least the student's"
        )
    if student_logits < tokenizer_size:
        raise ConfigError(
            f"the student outputs {student_logits} logits but its tokenizer has {tokenizer_size} tokens;"
            " the tokenizer does not belong to this model"
        )
    return student_logits
