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


def generation_opener(tokenizer) -> list[int]:
    """The ids the chat template adds to open the assistant's turn (`<|im_start|>assistant\n` for ChatML): what a
    student's and a teacher's prompt must both end with, so the response tokens follow the same turn marker."""
    chat = [{"role": "user", "content": "x"}]
    closed = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    opened = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if not opened.startswith(closed) or opened == closed:
        return []  # a template that rewrites earlier text when opening the turn: compared by the last token below
    return list(tokenizer(opened[len(closed) :], add_special_tokens=False)["input_ids"])


def check_same_opener(student: list[int], teacher: list[int], opener: list[int], row: str, fix: str) -> None:
    """Both prompts of `row` end with the assistant turn's `opener` ids (raw text, or no opener found: the same last
    token), so the response tokens sit where each expects its answer; a template that ends the two differently (a
    system text the teacher's messages drop, a think tag) would score the student's tokens at another position of
    the teacher's turn. `fix`: what the refusal tells the user to change."""
    tail = len(opener) or 1
    if student[-tail:] != teacher[-tail:]:
        raise ConfigError(
            f"{row}: the teacher prompt ends with ids {teacher[-tail:]} but the student's with {student[-tail:]}; the"
            " two open the answer differently, so the teacher would score the response at another position; " + fix
        )
