"""Lets sglang 0.5.17 import under a newer transformers: each engine process runs this at start-up
(rollout/sglang.py puts this folder first on the PYTHONPATH the engine's processes inherit, and imports it itself).

sglang 0.5.17 registers its own config classes under model types that transformers 5.17.0 already defines
(`AutoConfig.register("qwen3_asr", ...)` in sglang/srt/configs/qwen3_asr.py), and transformers refuses a second
registration: on the H200 machine the import, and the engine's scheduler process, died with "'qwen3_asr' is already
used by a Transformers config" (docs/benchmarks/sglang-gpu/run1.md). Registering with exist_ok=True lets SGLang's
class answer SGLang's own lookups of those types; miniVERL's models (qwen2, llama, ...) are not among them.
Python runs the first sitecustomize it finds on sys.path: in the engine's processes this one stands in for the
interpreter's own (Debian's only installs an apport hook).
"""

from __future__ import annotations


def allow_reregistration() -> None:
    """Make AutoConfig.register pass exist_ok=True (once per process; nothing without transformers)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return
    register = AutoConfig.register
    if getattr(register, "exist_ok_always", False):
        return

    def register_exist_ok(model_type, config, exist_ok=False):
        return register(model_type, config, exist_ok=True)

    register_exist_ok.exist_ok_always = True
    AutoConfig.register = staticmethod(register_exist_ok)


allow_reregistration()
