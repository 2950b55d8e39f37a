"""Lets sglang 0.5.17 import under a newer transformers: each engine process runs this at start-up
(rollout/sglang.py puts this folder first on the PYTHONPATH the engine's processes inherit, and imports it itself).

sglang 0.5.17 registers its own config classes under model types that transformers 5.17.0 already defines
(`AutoConfig.register("qwen3_asr", ...)` in sglang/srt/configs/qwen3_asr.py), and transformers refuses a second
registration: on the H200 machine the import, and the engine's scheduler process, died with "'qwen3_asr' is already
used by a Transformers config" (lab/results/sglang-gpu/run1.md). Registering with exist_ok=True lets SGLang's
class answer SGLang's own lookups of those types; miniVERL's models (qwen2, llama, ...) are not among them.
Python runs the first sitecustomize it finds on sys.path: in the engine's processes this one stands in for the
interpreter's own (Debian's only installs an apport hook).

With MINIVERL_SGLANG_BATCH_INVARIANT=0 (SglangSettings.batch_invariant=False, a run's) it also keeps SGLang's
batch-invariant mode off. 0.5.17 turns that mode on with deterministic inference, which row seeds need
(sampling_batch_info.py reads `sampling_seed` only then): its own Triton matmul, log-softmax, mean and RMSNorm kernels
replace cuBLAS's process-wide (model_runner.py maybe_enable_batch_invariant_mode). The seeds reach the sampler either
way.

With MINIVERL_SGLANG_MEMORY_CAP_BYTES (an emulated card: resources.emulate_gpu_gib) it caps torch's allocator in the
process that builds SGLang's ModelRunner, the scheduler, at the rollout actor's budget (cap_scheduler_memory).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

BATCH_INVARIANT_ENV = "MINIVERL_SGLANG_BATCH_INVARIANT"
BATCH_INVARIANT_MODULE = "sglang.srt.batch_invariant_ops"
MEMORY_CAP_ENV = "MINIVERL_SGLANG_MEMORY_CAP_BYTES"
MODEL_RUNNER_MODULE = "sglang.srt.model_executor.model_runner"


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


def after_import(name: str, patch) -> None:
    """`patch(module)` once the module `name` is imported in this process (at once where it already is)."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, patch))


def _batch_invariant_mode_off(module) -> None:
    module.enable_batch_invariant_mode = lambda *args, **kwargs: None


def keep_batch_invariant_mode_off() -> None:
    """With MINIVERL_SGLANG_BATCH_INVARIANT=0: SGLang's enable_batch_invariant_mode does nothing in this process."""
    if os.environ.get(BATCH_INVARIANT_ENV, "1") == "0":
        after_import(BATCH_INVARIANT_MODULE, _batch_invariant_mode_off)


def _capped_model_runner(module) -> None:
    init = module.ModelRunner.__init__
    if getattr(init, "miniverl_capped", False):
        return
    cap = int(os.environ[MEMORY_CAP_ENV])

    def capped_init(self, *args, **kwargs):
        import torch

        gpu = kwargs.get("gpu_id", args[2] if len(args) > 2 else 0)  # (model_config, mem_fraction_static, gpu_id, ...)
        total = torch.cuda.get_device_properties(gpu).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), gpu)
        init(self, *args, **kwargs)

    capped_init.miniverl_capped = True
    module.ModelRunner.__init__ = capped_init


def cap_scheduler_memory() -> None:
    """With MINIVERL_SGLANG_MEMORY_CAP_BYTES (set where the card is emulated): the process that builds SGLang's
    ModelRunner (the scheduler) caps torch's allocator there at that many bytes of its GPU before anything is
    allocated, as miniVERL caps every actor's process (process.py). Under the cap the allocator frees its cached blocks
    before it grows past it; uncapped, the scheduler of lab/results/sglang-gpu/run3.md kept 7.7 GiB against a 4.9 GiB
    budget."""
    if os.environ.get(MEMORY_CAP_ENV):
        after_import(MODEL_RUNNER_MODULE, _capped_model_runner)


allow_reregistration()
keep_batch_invariant_mode_off()
cap_scheduler_memory()
