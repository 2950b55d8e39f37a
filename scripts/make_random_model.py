"""Write a random-init model of a real architecture (no download) with a padded character tokenizer.

    python scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/models/student

Used for GPU measurements at real sizes: the weights are random, so rewards mean nothing, but memory
and time per step are those of the real shape.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# Shapes from DESIGN.md ("Models without downloads").
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, intermediate_size=8960),
}
QWEN_VOCAB = 151936
MAX_POSITIONS = 4096


def main() -> None:
    from miniverl.bench.config import ModelShape
    from miniverl.bench.workload import build_random_model
    from miniverl.models.tokenizer import save_char_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shape = ModelShape(
        **SHAPES[args.shape],
        num_key_value_heads=2,
        vocab_size=QWEN_VOCAB,
        tie_word_embeddings=True,
        max_position_embeddings=MAX_POSITIONS,
        init_seed=args.seed,
    )
    build_random_model(shape, torch.bfloat16, "cpu", Path(args.out))
    save_char_tokenizer(args.out, vocab_size=QWEN_VOCAB)
    print(f"wrote a random {args.shape} model to {args.out}")


if __name__ == "__main__":
    main()
