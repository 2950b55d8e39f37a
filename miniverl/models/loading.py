"""Resolve model references (built-in, local directory, hub id) and load models and tokenizers.

`builtin:teacher` and `builtin:student` name the embedded default models (built and cached on first
use); anything else goes through the same `from_pretrained` path a user's checkpoint takes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from miniverl.protocol import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str, device: str) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 on the CPU (CPU bf16 matmuls are slow and imprecise)."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def check_model_path(path: str, field: str) -> None:
    """Fail early, naming the field, when `path` is neither a model directory nor a plausible hub id."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ConfigError(
                f"{field}={path!r} is a directory without config.json; point it at a saved Hugging Face model"
                " (the folder save_pretrained wrote)"
            )
        return
    looks_local = path.startswith((".", "/", "~")) or p.suffix or path.count("/") > 1
    if looks_local or p.exists():
        raise ConfigError(
            f"{field}={path!r} does not exist; pass a saved model directory, a hub id such as"
            f" Qwen/Qwen2.5-0.5B, or builtin:student / builtin:teacher"
        )


def load_tokenizer(path: str, field: str = "model path"):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(Path(path).expanduser()) if Path(path).expanduser().exists() else path)
    except OSError as e:
        raise ConfigError(
            f"cannot load a tokenizer from {field}={path!r} ({e.__class__.__name__}); pass a local model"
            " directory, or a hub id on a machine that can reach the hub"
        ) from e


def load_causal_lm(path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    local = Path(path).expanduser()
    model = AutoModelForCausalLM.from_pretrained(str(local) if local.exists() else path, dtype=dtype)
    return model.to(device)


def check_same_vocabulary(student_tok, teacher_tok, student_path: str, teacher_path: str) -> None:
    """Distillation compares distributions token by token: both models must share one vocabulary."""
    s, t = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s != t:
        only_s = sorted(set(s) - set(t))[:5]
        only_t = sorted(set(t) - set(s))[:5]
        moved = sorted(k for k in set(s) & set(t) if s[k] != t[k])[:5]
        raise ConfigError(
            f"the teacher's vocabulary differs from the student's ({len(t)} vs {len(s)} tokens;"
            f" only in student: {only_s}, only in teacher: {only_t}, different ids: {moved});"
            f" pick a teacher from the same model family as {student_path!r} (it is {teacher_path!r})"
        )
