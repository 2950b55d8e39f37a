"""Write a random-init model of a real architecture (no download) with a padded character tokenizer.

    python scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/models/student

Used for GPU measurements at real sizes: the weights are random, so rewards mean nothing, but memory
and time per step are those of the real shape.
"""

from __future__ import annotations

import argparse

import torch

# Shapes from DESIGN.md ("Models without downloads").
SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        tie_word_embeddings=True,
    ),
}
QWEN_VOCAB = 151936


def main() -> None:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from miniverl.models.tokenizer import save_char_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    save_char_tokenizer(args.out, vocab_size=QWEN_VOCAB)
    tok = AutoTokenizer.from_pretrained(args.out)
    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=QWEN_VOCAB,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **SHAPES[args.shape],
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(args.out)
    print(f"wrote a random {args.shape} model to {args.out}")


if __name__ == "__main__":
    main()
