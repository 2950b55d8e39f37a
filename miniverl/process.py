"""How an actor process uses its hardware: its threads, its GPU memory cap and CUDA context, the CUDA capture lock;
and what the driver reads of the whole device's memory (device_used_gib).

A leaf: the workers, the rollout backends, the cluster launcher, the fit planner and the step's cadence all read it."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import torch

# One CUDA graph capture at a time in a process, and no release of the allocator's cache during one: torch asserts
# that no capture is underway in empty_cache(), and a colocated process (cluster/colocate.py) captures the rollout's
# decode graphs on one thread while the learner may give its cache back after running out of memory on another. A
# colocated compiled learner holds it through each of its calls (Inductor may compile and synchronize the device at
# any new shape), so it is reentrant: such a call's own cache release takes it again on the same thread.
CUDA_CAPTURE_LOCK = threading.RLock()


def release_cached_memory(device: str) -> None:
    """After an out-of-memory on `device`: the caching allocator's unused blocks back to the card (a no-op off CUDA),
    never during another thread's graph capture (CUDA_CAPTURE_LOCK). The learner's shrunk update and hf_cached's
    halved prefill pass both retry in what this frees."""
    if device.startswith("cuda"):
        with CUDA_CAPTURE_LOCK:
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class ProcessSettings:
    """How an actor process uses its hardware."""

    device: str  # "cpu" or "cuda"
    torch_threads: int = 0  # 0 = all cores
    # Cap this process's torch allocations at this much GPU memory (16 GB card emulation: its share of the card
    # less its CUDA context, emulated_cap_gib).
    gpu_memory_gib: float | None = None
    gpu_fraction: float = 1.0  # this actor's Ray share of its GPU (its memory budget when nothing caps it)
    # An actor process (cluster.launch.build_actors): SIGINT/SIGTERM are ignored, because a terminal's Ctrl-C, `timeout`
    # or a scheduler signal the whole process group, and stopping (checkpoint first) is the driver's job.
    actor: bool = False
    # False: gpu_memory_gib is this role's share inside a colocated process (cluster/colocate.py), for sizing only;
    # the process's cap (the sum of its roles') is set once by its host.
    process_cap: bool = True
    # sys.setswitchinterval for this process, seconds (resources.switch_interval_ms: colocated roles share one
    # interpreter); None keeps Python's.
    switch_interval_s: float | None = None
    # Whether torch's scaled_dot_product_attention may pick cuDNN's kernels on this process's GPU. A run's actors never
    # do: cuDNN plans every new micro-batch shape, 6.60 s against 4.12 s a realistic 4080 step (set_attention_backends;
    # lab/results/peers.md, 2026-12-06, 0f81ec5). Until 2026-12-07 the key resources.cudnn_attention; the lab's benches
    # set it on the settings they build (lab/bench_learner.py, lab/bench/scorer_profile.py).
    cudnn_attention: bool = False


# What every actor process holds on the GPU outside torch's allocator (its CUDA context, cuBLAS and NCCL
# handles): measured on the H200 as nvidia-smi's whole-device peak (15,666 MiB) less the three actors'
# torch-reserved peaks (13,650 MiB), per actor (torch 2.11, CUDA 13; lab/results/qlora-4080.md).
CUDA_CONTEXT_GIB = 0.66
# The same for the one process of resources.colocate=true (three roles on three threads and streams, an NF4 teacher's
# bitsandbytes kernels): 0.97 GiB measured on the H200 as nvidia-smi's whole-device peak less the process's
# torch-reserved peak, eager (11,783 - 10,790 MiB) and with compiled layers (12,603 - 11,610 MiB) alike
# (lab/results/qlora-4080.md, 2026-12-02's two colocated H200 cells). With 0.66 here the 12 GiB layout's process was
# capped at 11.34 GiB and the device peaked at 12.3 GiB.
COLOCATED_CONTEXT_GIB = 1.0


def emulated_card_gib(emulate_gpu_gib: float | None, device: str) -> float | None:
    """The card the actors' caps are cut from: resources.emulate_gpu_gib where it is set and the run computes on CUDA,
    else None (no caps)."""
    return emulate_gpu_gib if device == "cuda" and emulate_gpu_gib else None


def emulated_cap_gib(card_gib: float, fraction: float, what: str, context_gib: float = CUDA_CONTEXT_GIB) -> float:
    """An actor's torch memory cap on an emulated card of `card_gib`: its fraction of the card less its own
    CUDA context (`context_gib`: COLOCATED_CONTEXT_GIB for the colocated process), so the actors' caps and
    contexts together fit the card nvidia-smi would show."""
    from miniverl.errors import ConfigError

    cap = card_gib * fraction - context_gib
    if cap <= 0:
        raise ConfigError(
            f"{what}={fraction:g} of resources.emulate_gpu_gib={card_gib:g} is {card_gib * fraction:.2f} GiB, no more"
            f" than the {context_gib} GiB its CUDA context takes; give that actor a larger share"
        )
    return cap


def memory_share_bytes(settings: ProcessSettings) -> int:
    """The GPU memory this actor may plan for: its emulated cap, else its Ray fraction of the device less
    its CUDA context."""
    if settings.gpu_memory_gib is not None:
        return int(settings.gpu_memory_gib * 2**30)
    total = torch.cuda.get_device_properties(0).total_memory
    return int(settings.gpu_fraction * total - CUDA_CONTEXT_GIB * 2**30)


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
    if settings.switch_interval_s is not None:
        sys.setswitchinterval(settings.switch_interval_s)
        print(f"process: Python switch interval {sys.getswitchinterval() * 1e3:g} ms", flush=True)
    if settings.device != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("this actor was asked to use CUDA but sees no GPU (CUDA_VISIBLE_DEVICES is empty?)")
    if settings.gpu_memory_gib is not None and settings.process_cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.gpu_memory_gib * 2**30 / total), 0)
    set_attention_backends(settings.cudnn_attention)
    record_memory_history()
    return "cuda"


def set_attention_backends(cudnn: bool) -> None:
    """Whether torch's scaled_dot_product_attention may use cuDNN in this process (`cudnn`), or only flash,
    memory-efficient and math attention. On Hopper and newer cards torch 2.9+ tries cuDNN first, and cuDNN builds an
    execution plan for every new (rows, heads, length) shape it sees, tens of milliseconds or more each (torch's
    TORCH_CUDNN_SDPA_AVOID_RECOMPILE names that cost; with compiled layers it fails on torch 2.11). The learner's
    micro-batches and the teacher's forwards of rows that stop at different lengths are new shapes every step: in
    lab/results/peers.md (2026-12-06, 0f81ec5) a new shape's first call took 130 ms against 1 ms repeated, and the
    realistic 4080 step 6.60 s with cuDNN allowed against 4.12 s without (update 3.35 -> 1.76 s, scoring 1.85 ->
    1.15 s). Flash attention has no per-shape plan and cost nothing measurable where shapes repeat. Every actor of a
    run sets the same (hf_cached's own attention is not SDPA).

    torch picks SDPA's kernel when it traces a compiled graph, and compiled code's guards do not look at this setting:
    after a change, layers compiled before would keep the old kernel (that sitting's learner bench ran its cuDNN cells
    on the flash cell's compiled layers so). A change therefore clears torch.compile's caches, where torch.compile has
    been loaded in this process."""
    if torch.backends.cuda.cudnn_sdp_enabled() != cudnn and "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    torch.backends.cuda.enable_cudnn_sdp(cudnn)


MEMORY_HISTORY_ENV = "MINIVERL_CUDA_MEMORY_HISTORY"
_history = {"on": False}


def memory_history_requested() -> bool:
    """Whether MINIVERL_CUDA_MEMORY_HISTORY asks every actor to record where its GPU blocks are allocated (1) or not
    (0 or unset); any other value is refused with the fix."""
    import os

    from miniverl.errors import ConfigError

    value = os.environ.get(MEMORY_HISTORY_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ConfigError(f"{MEMORY_HISTORY_ENV}={value!r}: set it to 1 (record) or 0 (off)")
    return value == "1"


def record_memory_history() -> bool:
    """A diagnostic, off by default: with MINIVERL_CUDA_MEMORY_HISTORY=1 this process records the Python stack of
    every GPU block it allocates from now on (torch's memory history: each allocation pays for a Python stack walk), so
    an out-of-memory line can say which code holds the memory (`allocation_sites_note`). Ray actors inherit the
    driver's environment. The rollout of lab/results/peers.md's 2026-12-06 sitting at 0724e28 held 0.80 GiB beside its
    model and decode cache that no Python-visible tensor accounts for. Returns whether it records."""
    if not memory_history_requested() or not torch.cuda.is_available():
        return False
    # "state": the stacks of the live blocks only (no event log); "python": no C++ unwinding at each allocation
    torch.cuda.memory._record_memory_history(enabled="state", stacks="python")
    _history["on"] = True
    return True


def allocation_sites(snapshot: dict, top: int = 6, code: str = "miniverl/") -> list[tuple[str, int]]:
    """Bytes of the live allocated blocks in a torch memory snapshot (torch.cuda.memory._snapshot()), by where they
    were allocated: the innermost stack frame in `code` (the call in this project that asked for it, whatever torch
    or transformers function allocated inside it), else the innermost frame, else "allocated before the history
    started". The `top` largest, largest first."""
    sites: dict[str, int] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            ours = [f for f in frames if code in f.get("filename", "")]
            frame = (ours or frames or [None])[0]
            if frame is None:
                site = "allocated before the history started"
            else:
                name = frame["filename"]
                name = name[name.rindex(code) :] if code in name else name.rsplit("/", 1)[-1]
                site = f"{name}:{frame.get('line', '?')} {frame.get('name', '?')}"
            sites[site] = sites.get(site, 0) + block["size"]
    return sorted(sites.items(), key=lambda kv: -kv[1])[:top]


def allocation_sites_note() -> str:
    """'; live GPU blocks by where they were allocated: 0.62 GiB at file:line function, ...' for an out-of-memory
    line, when this process records its memory history (record_memory_history); else empty."""
    if not _history["on"]:
        return ""
    sites = allocation_sites(torch.cuda.memory._snapshot())
    listed = ", ".join(f"{size / 2**30:.2f} GiB at {site}" for site, size in sites)
    return f"; live GPU blocks by where they were allocated: {listed}"


def memory_report(device: str) -> dict[str, float]:
    """Peak GPU memory this process allocated/reserved (GiB), and how often torch's allocator found no room under
    the cap, gave its cached blocks back to the card and asked again (`alloc_retries`): each is a device-wide
    synchronisation (lab/results/peers.md, 2026-12-06's H100 cells: suspected of slowing the learner and scorer at
    their caps, ruled out by this count, 0-1 there against the capped rollout's 13). Empty on the CPU."""
    if device != "cuda":
        return {}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "alloc_retries": float(torch.cuda.memory_stats().get("num_alloc_retries", 0)),
    }


def gpu_uuid(device: str) -> str | None:
    """The UUID of the physical GPU this process computes on (its CUDA device 0), None on the CPU. Two actors
    with the same UUID share one GPU whatever CUDA_VISIBLE_DEVICES calls it in each."""
    if device != "cuda":
        return None
    return str(torch.cuda.get_device_properties(0).uuid)


# Whole-device GPU memory as nvidia-smi reports it, read through NVML from the driver process.
#
# NVML needs no CUDA context, so reading it from the driver does not itself take GPU memory (a CUDA context
# would add ~0.5 GiB to what it measures). NVML's first memory query counts the driver's reserved memory as used;
# nvidia-smi's `memory.used` does not (it reads the v2 query): on the H200, 615 MiB apart (qlora-4080.md's vLLM cell
# of 2026-12-03, 5edc809: 16,389 MiB by the first query, 15,774 by nvidia-smi). The v2 query is used where the driver
# has it: on the H200 (driver 580.159.04) with 3 GiB allocated it read 3,599 MiB, as nvidia-smi did, the first query
# 4,214.
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
