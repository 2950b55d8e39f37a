"""Tiny stand-ins for an instruct model family, built by the project (no downloads).

A byte-level BPE tokenizer with a Qwen-style chat template and two EOS ids (`<|im_end|>` ends a turn,
`<|endoftext|>` ends a document; the model's generation_config lists both, as Qwen2.5-Instruct's does),
random-init tiny Qwen2 models whose output layers are padded past the tokenizer by different amounts
(as Qwen2.5-0.5B's 151,936 vs 7B's 152,064 logits), and GSM8K-format prompt files.
"""

from __future__ import annotations

import json
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "The answer is #### 72. Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes.",
    "You are a helpful assistant. system user assistant 0 1 2 3 4 5 6 7 8 9 + - = \\boxed{}",
]
BPE_VOCAB = 300  # 256 byte symbols, 3 specials and a few merges


def save_chat_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT)
    fast.chat_template = QWEN_STYLE_TEMPLATE
    fast.save_pretrained(str(directory))


def save_tiny_qwen(directory: Path, vocab_size: int, seed: int, hidden: int = 32) -> None:
    """A random-init Qwen2 with `vocab_size` logits, the chat tokenizer and both EOS ids in generation_config."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    save_chat_tokenizer(directory)
    tok = AutoTokenizer.from_pretrained(str(directory))
    eos = [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)]
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=hidden * 2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(str(directory))
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id).save_pretrained(str(directory))


def gsm8k_rows(count: int, source: str = "openai/gsm8k") -> list[dict]:
    """verl-schema rows as verl's gsm8k preprocessor writes them (question i: i + i = ?)."""
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f'What is {i} + {i}? Output the final answer after "####".'}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(count)
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
