"""The lab's tests run on the product tests' fixtures: the same tiny models, built by the project's own code, and the
same one-thread, seeded torch (tests/conftest.py)."""

from tests.conftest import (  # noqa: F401 (fixtures, found by name)
    _deterministic,
    _one_torch_thread,
    random_model_dir,
    student_dir,
    teacher_dir,
)
