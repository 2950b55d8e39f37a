"""Whole-device GPU memory as nvidia-smi reports it, read through NVML from the driver process.

NVML needs no CUDA context, so reading it from the driver does not itself take GPU memory (a CUDA context
would add ~0.5 GiB to what it measures).
"""

from __future__ import annotations


def device_used_gib(index: int = 0) -> float | None:
    """Used memory of GPU `index` in GiB (all processes), or None without NVML or a GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used / 2**30
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
