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
    gpu_fraction: float = 1.0  # this actor's Ray share of its GPU (its memory budget when nothing caps it)


def memory_share_bytes(settings: ProcessSettings) -> int:
    """The GPU memory this actor may plan for: its emulated cap, else its Ray fraction of the device."""
    if settings.gpu_memory_gib is not None:
        return int(settings.gpu_memory_gib * 2**30)
    return int(settings.gpu_fraction * torch.cuda.get_device_properties(0).total_memory)


def setup_process(settings: ProcessSettings) -> str:
    """Apply thread and memory settings; return the torch device string for this actor."""
    import os

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
