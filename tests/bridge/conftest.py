"""Fixtures for the bridge tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bridge.helpers import clean_config


@pytest.fixture
def clean(tmp_path, student_dir, teacher_dir) -> dict:
    """A composed config verl 0.9 can reproduce (PG-k1 on vLLM, teacher on its own GPU, local tiny models)."""
    return clean_config(tmp_path / "cache", student_dir, teacher_dir)


# A chat template with its own turn markers (the tiny tokenizer's special tokens), the generation prompt
# opening the assistant turn: enough to tell a templated prompt from a raw one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture
def templated_student(tmp_path, student_dir) -> Path:
    """The tiny student with a chat template on its tokenizer (data.chat_template=true runs need one)."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path / "templated_student"
    shutil.copytree(student_dir, path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    return path
