"""Prompt text -> token ids: the tokenizer's chat template, or raw text for models trained without one."""

from __future__ import annotations

from typing import Any

from miniverl.errors import ConfigError


def encode_prompt(tokenizer, messages: list[dict[str, Any]], use_template: bool) -> list[int]:
    """Token ids of a prompt given as chat messages.

    With the template the ids end with the assistant-turn opener (`add_generation_prompt`), exactly
    what the model sees before answering. The template text already holds the special tokens it
    needs, so it is encoded without adding any (no second BOS). Raw mode takes one user message's
    text and encodes it as the tokenizer does by default.
    """
    if use_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "data.chat_template=true but the student's tokenizer has no chat template; set"
                " data.chat_template=false to feed prompts as raw text, or use an instruct model's tokenizer"
            )
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(messages) != 1 or messages[0].get("role") != "user":
        raise ConfigError(
            f"data.chat_template=false needs text prompts, but a prompt is a chat of {len(messages)} messages"
            f" ({[m.get('role') for m in messages]}); set data.chat_template=true"
        )
    return list(tokenizer(messages[0]["content"])["input_ids"])
