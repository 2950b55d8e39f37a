"""Write a random-init model of a real architecture (no download) with a padded character tokenizer.

    python scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/models/student

Used for GPU measurements at real sizes: the weights are random, so rewards mean nothing, but memory
and time per step are those of the real shape.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from miniverl.models.random_init import QWEN_VOCAB, REAL_SHAPES, build_random_model, real_shape
from miniverl.models.tokenizer import save_char_tokenizer

MAX_POSITIONS = 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(REAL_SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the weights are drawn (auto: cuda when there is one, a 1.5B shape in seconds rather than ~35 s of"
        " a device session; other draws than the cpu's, the same shapes)",
    )
    args = ap.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    build_random_model(real_shape(args.shape, MAX_POSITIONS, args.seed), torch.bfloat16, device, Path(args.out))
    save_char_tokenizer(args.out, vocab_size=QWEN_VOCAB)
    print(f"wrote a random {args.shape} model to {args.out}")


if __name__ == "__main__":
    main()
