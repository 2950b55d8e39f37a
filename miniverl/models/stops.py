"""Which token ids end a response: every EOS the model declares, plus the user's extra ids.

Instruct models end a turn with a token that is not the tokenizer's `eos_token` (Qwen2.5-Instruct:
`<|im_end|>` in the tokenizer, `[<|im_end|>, <|endoftext|>]` in generation_config.json); stopping on
one id only lets every row run to max_new_tokens.
"""

from __future__ import annotations

from miniverl.errors import ConfigError


def declared_eos_ids(model_path: str) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list), or [] when the model has none."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS is all there is
        return []
    return eos_id_list(eos)


def eos_id_list(eos: int | list[int] | None) -> list[int]:
    """A generation config's eos_token_id (an int, a list or None) as a list of ids."""
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def stop_token_ids(
    tokenizer_eos: int | None, generation_eos: list[int], extra: list[int], vocab_size: int
) -> tuple[int, ...]:
    """The union of the tokenizer's EOS, generation_config's EOS ids and `extra`, first seen first.

    Raises ConfigError when there is none (responses could never stop) or one is outside the vocabulary.
    """
    ids = list(dict.fromkeys([*([tokenizer_eos] if tokenizer_eos is not None else []), *generation_eos, *extra]))
    if not ids:
        raise ConfigError(
            "the student declares no EOS token (tokenizer or generation_config), so responses could never stop;"
            " set rollout.stop_token_ids=[<id>, ...]"
        )
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(
            f"stop ids {bad} are outside the student's vocabulary of {vocab_size} logits; fix rollout.stop_token_ids"
        )
    return tuple(ids)


def resolve_stop_ids(tokenizer, model_path: str, extra: list[int], vocab_size: int) -> tuple[int, ...]:
    """The run's stop ids for the student at `model_path` (tokenizer + generation_config + rollout.stop_token_ids)."""
    return stop_token_ids(tokenizer.eos_token_id, declared_eos_ids(model_path), list(extra), vocab_size)
