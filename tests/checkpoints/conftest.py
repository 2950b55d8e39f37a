"""The strict-sync parts (tokenizer, prompts, learner, scorer) of tests/test_controller.py, shared here."""

from tests.test_controller import parts  # noqa: F401 (a fixture, found by name)
