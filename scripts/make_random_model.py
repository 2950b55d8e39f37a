"""Write a random-init model of a real architecture (no download) with a padded character tokenizer.

    python scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/models/student

Used for GPU measurements at real sizes: the weights are random, so rewards mean nothing, but memory
and time per step are those of the real shape.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from miniverl.bench.workload import QWEN_VOCAB, REAL_SHAPES, build_random_model, real_shape
from miniverl.models.tokenizer import save_char_tokenizer

MAX_POSITIONS = 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(REAL_SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: a 7B shape in seconds)")
    args = ap.parse_args()
    build_random_model(real_shape(args.shape, MAX_POSITIONS, args.seed), torch.bfloat16, args.device, Path(args.out))
    save_char_tokenizer(args.out, vocab_size=QWEN_VOCAB)
    print(f"wrote a random {args.shape} model to {args.out}")


if __name__ == "__main__":
    main()
