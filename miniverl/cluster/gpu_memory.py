"""Whole-device GPU memory as nvidia-smi reports it, read through NVML from the driver process.

NVML needs no CUDA context, so reading it from the driver does not itself take GPU memory (a CUDA context
would add ~0.5 GiB to what it measures). NVML's first memory query counts the driver's reserved memory as used;
nvidia-smi's `memory.used` does not (it reads the v2 query): on the H200, 615 MiB apart (qlora-4080.md's vLLM cell
of 2026-12-03, 5edc809: 16,389 MiB by the first query, 15,774 by nvidia-smi). The v2 query is used where the driver has
it: on the H200 (driver 580.159.04) with 3 GiB allocated it read 3,599 MiB, as nvidia-smi did, the first query 4,214.
"""

from __future__ import annotations


def device_used_gib(index: int = 0) -> float | None:
    """Used memory of GPU `index` in GiB (all processes, the driver's reserve not counted), or None without NVML or
    a GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return _used_bytes(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)) / 2**30
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


def _used_bytes(pynvml, handle) -> int:
    version = getattr(pynvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(handle, version=version).used
        except pynvml.NVMLError:  # a driver without the v2 query: the first one, reserve included
            pass
    return pynvml.nvmlDeviceGetMemoryInfo(handle).used
