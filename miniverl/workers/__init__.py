"""The three actors as plain classes: a test builds them in-process; miniverl.actors makes them Ray actors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProcessSettings:
    """How an actor process uses its hardware."""

    device: str  # "cpu" or "cuda"
    torch_threads: int = 0  # 0 = all cores
    gpu_memory_gib: float | None = None  # cap this process at this much GPU memory (16 GB card emulation)
    # An actor process (run.build_actors): SIGINT/SIGTERM are ignored, because a terminal's Ctrl-C, `timeout`
    # or a scheduler signal the whole process group, and stopping (checkpoint first) is the driver's job.
    actor: bool = False


# Loggers whose notes only alarm a user: bitsandbytes' CPU backend asks every process to
# `pip install kernels`, an optional faster 4-bit CPU kernel that miniVERL never uses (NF4 is CUDA-only here).
QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def quiet_library_notes() -> None:
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def ignore_stop_signals() -> None:
    """Leave SIGINT/SIGTERM to the driver (only in the main thread, where handlers can be set)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def setup_process(settings: ProcessSettings) -> str:
    """Apply thread and memory settings; return the torch device string for this actor."""
    import os

    quiet_library_notes()
    if settings.actor:
        ignore_stop_signals()
    torch.set_num_threads(settings.torch_threads or os.cpu_count() or 1)
    if settings.device != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("this actor was asked to use CUDA but sees no GPU (CUDA_VISIBLE_DEVICES is empty?)")
    if settings.gpu_memory_gib is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.gpu_memory_gib * 2**30 / total), 0)
    return "cuda"


def memory_report(device: str) -> dict[str, float]:
    """Peak GPU memory this process allocated/reserved (GiB); empty on the CPU."""
    if device != "cuda":
        return {}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }
