"""Random-init Qwen2 decoders of real architectures, built from a transformers Qwen2Config (no downloads): what
scripts/make_random_model.py writes for GPU runs at real sizes, what the tests plan and train on, and the shapes the
lab's benches measure (DESIGN.md, "Models without downloads")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING


@dataclass
class ModelShape:
    """A random-init Qwen2 decoder. No defaults on purpose: a bench file that embeds one states every value."""

    hidden_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    intermediate_size: int = MISSING
    vocab_size: int = MISSING
    tie_word_embeddings: bool = MISSING
    max_position_embeddings: int = MISSING
    init_seed: int = MISSING


# Qwen2.5 0.5B and 1.5B (two KV heads, the 151,936-token vocabulary, tied embeddings) and 7B (four KV heads, 152,064
# logits, an untied head: the teacher's vocabulary padded past the student's, as the real pair).
QWEN_VOCAB = 151936
REAL_SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, intermediate_size=8960),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        intermediate_size=18944,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def real_shape(name: str, max_positions: int, seed: int = 0) -> ModelShape:
    """The ModelShape of a REAL_SHAPES entry (random init from `seed`)."""
    small = dict(num_key_value_heads=2, vocab_size=QWEN_VOCAB, tie_word_embeddings=True)
    return ModelShape(**(small | REAL_SHAPES[name]), max_position_embeddings=max_positions, init_seed=seed)


def qwen2_config(shape: ModelShape):
    """The transformers Qwen2Config of `shape` (what build_random_model saves; the fit planner's tests plan from it)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
    )


def build_random_model(shape: ModelShape, dtype: torch.dtype, device: str, target: Path) -> Path:
    """Save a random-init Qwen2 decoder of `shape` to `target` (config.json + safetensors) and return it."""
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(shape)
    torch.manual_seed(shape.init_seed)
    with torch.device(device):  # initializing 0.5B parameters on the GPU takes seconds, not a minute
        model = Qwen2ForCausalLM(config)
    model.to(dtype).save_pretrained(str(target))
    del model
    return target
