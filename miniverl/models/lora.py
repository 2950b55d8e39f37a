"""The student with a LoRA adapter (peft), built the same way by the learner and the HF rollout backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miniverl.models.loading import load_causal_lm


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


def build_lora_model(path: str, lora: LoraSettings, dtype: torch.dtype, device: str, quantization: str = "none"):
    """Base model from `path` wrapped with a fresh adapter; lora_B starts at 0, so it serves the base.

    `quantization` nf4 gives a QLoRA student: the base is 4-bit (models/loading.py), the adapter is not.
    peft's prepare_model_for_kbit_training is deliberately not called: it casts every bf16 non-quantized
    weight (embeddings, norms, LM head) to fp32, which at a 152k vocabulary adds 0.27 GB for the embedding
    alone on a 16 GB card; what it does besides is freezing the base (get_peft_model does that) and making
    inputs require grad for reentrant checkpointing (the learner uses the non-reentrant kind).
    """
    from peft import LoraConfig, get_peft_model

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
    return get_peft_model(base, config)


def live_adapter(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's portable names, where they live (the model's own storage: no copy)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's portable names, copied to the CPU."""
    return {k: v.to("cpu", copy=True) for k, v in live_adapter(model).items()}


def load_adapter_state(model, weights: dict[str, torch.Tensor]) -> None:
    """Load `weights` into the model's adapter; a name that matches nothing is an error, not a no-op."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(model))  # names only: no copy of the old adapter off the device
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights))[:3], sorted(set(weights) - expected)[:3]
        raise ValueError(
            f"adapter names do not match the served model (missing {missing}, unexpected {extra});"
            " learner and rollout must use the same model.lora settings"
        )
    set_peft_model_state_dict(model, weights)
