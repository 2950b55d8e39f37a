"""Lets sglang 0.5.17 import under a newer transformers: each engine process runs this at start-up
(rollout/sglang.py puts this folder first on the PYTHONPATH the engine's processes inherit, and imports it itself).

sglang 0.5.17 registers its own config classes under model types that transformers 5.17.0 already defines
(`AutoConfig.register("qwen3_asr", ...)` in sglang/srt/configs/qwen3_asr.py), and transformers refuses a second
registration: on the H200 machine the import, and the engine's scheduler process, died with "'qwen3_asr' is already
used by a Transformers config" (docs/benchmarks/sglang-gpu/run1.md). Registering with exist_ok=True lets SGLang's
class answer SGLang's own lookups of those types; miniVERL's models (qwen2, llama, ...) are not among them.
Python runs the first sitecustomize it finds on sys.path: in the engine's processes this one stands in for the
interpreter's own (Debian's only installs an apport hook).

With MINIVERL_SGLANG_BATCH_INVARIANT=0 (rollout.sglang.batch_invariant=false) it also keeps SGLang's batch-invariant
mode off. 0.5.17 turns that mode on with deterministic inference, which row seeds need (sampling_batch_info.py reads
`sampling_seed` only then): its own Triton matmul, log-softmax, mean and RMSNorm kernels replace cuBLAS's process-wide
(model_runner.py maybe_enable_batch_invariant_mode). The seeds reach the sampler either way.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

BATCH_INVARIANT_ENV = "MINIVERL_SGLANG_BATCH_INVARIANT"
BATCH_INVARIANT_MODULE = "sglang.srt.batch_invariant_ops"


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


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after the module `name` is first executed (Python has no post-import hook)."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    self.patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def _batch_invariant_mode_off(module) -> None:
    module.enable_batch_invariant_mode = lambda *args, **kwargs: None


def keep_batch_invariant_mode_off() -> None:
    """With MINIVERL_SGLANG_BATCH_INVARIANT=0: SGLang's enable_batch_invariant_mode does nothing in this process."""
    if os.environ.get(BATCH_INVARIANT_ENV, "1") != "0":
        return
    if BATCH_INVARIANT_MODULE in sys.modules:
        _batch_invariant_mode_off(sys.modules[BATCH_INVARIANT_MODULE])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(BATCH_INVARIANT_MODULE, _batch_invariant_mode_off))


allow_reregistration()
keep_batch_invariant_mode_off()
