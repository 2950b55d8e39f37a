"""A character-level tokenizer saved in Hugging Face format.

The same files load with `AutoTokenizer.from_pretrained`, and the ids are plain integers, so an engine
can serve the model from raw token ids (vLLM with `skip_tokenizer_init=True`).
"""

from __future__ import annotations

from pathlib import Path

from miniverl.data.tasks import TASK_ALPHABET

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3


def save_char_tokenizer(directory: str | Path, alphabet: str = TASK_ALPHABET, vocab_size: int | None = None) -> None:
    """Write tokenizer.json + tokenizer_config.json: one token per character, BOS prepended on encode.

    `vocab_size` pads the vocabulary with unused `<extra_i>` tokens, so a model of a real shape (for
    example 151936 logits, Qwen2.5) can be paired with this tokenizer for benchmarks.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = [*SPECIAL_TOKENS, *dict.fromkeys(alphabet)]
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(tokens)} tokens of the alphabet")
        tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # every character alone
    tok.decoder = decoders.Fuse()  # join characters without spaces
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    fast.save_pretrained(str(directory))
