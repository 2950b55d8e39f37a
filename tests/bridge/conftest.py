"""Fixtures for the bridge tests."""

from __future__ import annotations

import pytest

from tests.bridge.helpers import clean_config


@pytest.fixture
def clean(tmp_path, student_dir, teacher_dir) -> dict:
    """A composed config verl 0.9 can reproduce (PG-k1 on vLLM, teacher on its own GPU, local tiny models)."""
    return clean_config(tmp_path / "cache", student_dir, teacher_dir)
