"""Tiny random-init Qwen2 checkpoints for the GPU tests, through the bench's own builder (one way to make one)."""

from __future__ import annotations

from pathlib import Path

import torch

from miniverl.models.random_init import ModelShape, build_random_model


def save_random_qwen2(path: Path, hidden_size: int, intermediate_size: int, vocab_size: int) -> Path:
    """2 layers, 4 heads (2 KV heads), tied embeddings, 1024 positions, seed 0, saved in bf16."""
    shape = ModelShape(
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        init_seed=0,
    )
    return build_random_model(shape, torch.bfloat16, "cpu", path)
