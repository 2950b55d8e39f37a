"""Which policy a component holds: its identity (version and weights digest), what the learner publishes, and
what a rollout replica reports it serves (`ServedPolicy`: its digest of its own serving buffers; step/sync.py).

The learner publishes its adapter one of two ways (resources.weight_sync, chosen once per run by
miniverl/step/sync.py):
- through the host: CPU copies of the tensors in the snapshot (Ray's object store carries them);
- on the device, when every rollout replica sits on the learner's GPU: the learner copies the adapter into one
  flat buffer of its own GPU memory and the snapshot carries that buffer's CUDA IPC handle and layout
  (`SharedWeights`); a replica maps the buffer and copies the adapter device to device. Nothing adapter-sized
  crosses the host, so a refresh does no O(adapter) work on the CPU.

The digest (the policy's name) is computed where the tensors are, by integer arithmetic that gives the same
result on any device (`weights_digest`), so publishing on the GPU needs no copy to the host either.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch

DIGEST_PREFIX = "fp1-"  # digests without it are the SHA-256 digests of checkpoints written before fp1
ALIGN = 16  # bytes: every tensor of a flat buffer starts at a multiple (dtype views, vectorized copies)
CHUNK = 1 << 22  # int16 words per fingerprint pass: bounds its int64 temporary at 32 MiB
MODULUS = (1 << 61) - 1  # a prime; every partial sum below stays under 2**62, so int64 never overflows
# The fingerprint's two position weights: word i is weighed (i * multiplier + offset) % period + 1, periodic in i,
# so the buffer laid out `period` words wide is reduced column by column and the columns weighed once.
WEIGHTS = ((40503, 1, 65521), (7919, 17, 65519))  # (multiplier, offset, period): periods are primes below 2**16
FLUSH_ROWS = 1 << 13  # rows summed per column before weighing: 2**16 * rows * 2**16 * period stays below 2**62


@dataclass(frozen=True)
class PolicyIdentity:
    """Which policy a component holds: a monotonic version and a digest of the trainable weights."""

    version: int
    digest: str

    def short(self) -> str:
        return f"v{self.version}:{self.digest.removeprefix(DIGEST_PREFIX)[:12]}"


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor sits in a flat byte buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start, a multiple of ALIGN
    nbytes: int


def flat_layout(weights: dict[str, torch.Tensor]) -> tuple[TensorSlot, ...]:
    """Slots for `weights` in sorted-name order, each aligned to ALIGN bytes."""
    slots, offset = [], 0
    for name in sorted(weights):
        t = weights[name]
        nbytes = t.numel() * t.element_size()
        slots.append(TensorSlot(name, t.dtype, tuple(t.shape), offset, nbytes))
        offset += _aligned(nbytes)
    return tuple(slots)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def layout_bytes(layout: tuple[TensorSlot, ...]) -> int:
    return max((s.offset + _aligned(s.nbytes) for s in layout), default=0)


def slot_views(flat: torch.Tensor, layout: tuple[TensorSlot, ...]) -> dict[str, torch.Tensor]:
    """Each slot of a flat uint8 buffer as a tensor of its dtype and shape (views: no copy)."""
    return {s.name: flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in layout}


def pack(weights: dict[str, torch.Tensor], layout: tuple[TensorSlot, ...], out: torch.Tensor | None = None):
    """`weights` copied into one flat uint8 buffer (`out`, reused when given; padding bytes stay zero).
    Shapes: -> [layout_bytes(layout)] uint8 on the tensors' device."""
    if out is None:
        device = next(iter(weights.values())).device if weights else torch.device("cpu")
        out = torch.zeros(layout_bytes(layout), dtype=torch.uint8, device=device)
    for name, view in slot_views(out, layout).items():
        view.copy_(weights[name].detach())
    return out


def _fingerprint(flat: torch.Tensor) -> list[int]:
    """Two position-weighted sums of the buffer's 16-bit words modulo a prime, computed where the buffer is.
    Exact integer arithmetic: the same numbers on any device. A change of any single word changes both sums
    (word delta and weight are non-zero and their product is smaller than the modulus). Not a cryptographic
    hash: it names policies and catches corruption, it does not resist someone forging weights. `flat` is a
    packed buffer (a multiple of ALIGN bytes, so whole 16-bit words).

    Sum_i (word_i + 32768) * weight(i), with weight periodic in i (WEIGHTS): the words laid out `period` wide
    are summed per column (one reduction a CHUNK of words, no per-word index arithmetic), the columns weighed
    once, the words after the last whole row weighed directly. The same value as weighing every word, in a
    few dozen kernels instead of a few hundred (a refresh digests the adapter twice: learner and replica)."""
    words = flat.view(torch.int16)
    out = []
    for multiplier, offset, period in WEIGHTS:
        span = min(period, words.numel())  # a buffer shorter than a period needs only its own weights
        weight = (torch.arange(span, dtype=torch.int64, device=flat.device) * multiplier + offset) % period + 1
        rows = words.numel() // period
        step = max(1, CHUNK // period)  # rows per reduction
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        for first in range(0, rows, FLUSH_ROWS):
            last = min(rows, first + FLUSH_ROWS)
            columns = torch.zeros(period, dtype=torch.int64, device=flat.device)  # [period]
            for r in range(first, last, step):
                block = words[r * period : min(last, r + step) * period].view(-1, period)  # [rows, period]
                columns += block.sum(dim=0, dtype=torch.int64)
            columns += 32768 * (last - first)  # the offset of every word: (word + 32768) is in [0, 65535]
            total = (total + (columns * weight).sum()) % MODULUS
        tail = words[rows * period :].to(torch.int64) + 32768  # [< period]
        out.append((total + (tail * weight[: tail.numel()]).sum()) % MODULUS)
    return torch.stack(out).tolist()


def flat_digest(flat: torch.Tensor, layout: tuple[TensorSlot, ...]) -> str:
    """The digest of a packed buffer: names, dtypes, shapes and offsets, and the fingerprint of its bytes."""
    h = hashlib.sha256()
    for s in layout:
        h.update(f"{s.name}|{s.dtype}|{s.shape}|{s.offset}|{s.nbytes};".encode())
    h.update(repr(_fingerprint(flat)).encode())
    return DIGEST_PREFIX + h.hexdigest()


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """The policy's name: `flat_digest` of `weights` packed in sorted-name order, on the tensors' device.

    The learner names what it publishes, saves or restores by it. A rollout replica whose serving path reads
    adapter buffers of its own (hf_reference, hf_cached) digests those buffers the same way after every load
    (its served digest: miniverl/step/sync.py): equal digests mean it serves the published adapter bit for
    bit. No digest sees the base model or the engine's arithmetic: the strict-sync probe proves those
    (miniverl/served_policy.py).
    """
    layout = flat_layout(weights)
    return flat_digest(pack(weights, layout), layout)


class FlatCopy:
    """The same tensors every time (written in place between calls) and one flat buffer on their device that
    `digest()` copies them into before digesting it: the learner's published adapter (the buffer replicas on its
    GPU map: `shared()`), a replica's served one. Built once, so a refresh walks no module tree and makes no
    per-tensor views; the copy is one multi-tensor copy.

    Shapes: flat [layout_bytes(layout)] uint8 on the tensors' device.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.layout = flat_layout(tensors)
        self.flat = pack(tensors, self.layout)
        self._slots = list(slot_views(self.flat, self.layout).values())  # layout order
        self._sources = [tensors[s.name] for s in self.layout]
        self._shared: SharedWeights | None = None

    def digest(self) -> str:
        """Copy the tensors' current values into the buffer and return its digest (`weights_digest` of the
        tensors); it waits for the copy, so whoever reads the buffer next reads finished bytes."""
        torch._foreach_copy_(self._slots, self._sources)  # one call (fused kernels where the slots allow it)
        return flat_digest(self.flat, self.layout)

    def cpu_copies(self) -> dict[str, torch.Tensor]:
        """The tensors copied to the CPU, one tensor each (Ray pickles each as its own bytes)."""
        return {k: v.to("cpu", copy=True) for k, v in self.tensors.items()}

    def shared(self) -> SharedWeights:
        """The buffer's CUDA IPC handle, made once (a replica maps it once too: SharedWeights.open)."""
        if self._shared is None:
            self._shared = SharedWeights.of(self.flat, self.layout)
        return self._shared


def sha256_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over sorted names, dtypes, shapes and raw bytes: the digest checkpoints recorded before fp1."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def digest_matches(weights: dict[str, torch.Tensor], recorded: str, digest: str | None = None) -> bool:
    """Whether `weights` carry the digest a checkpoint recorded, whichever scheme recorded it. `digest`: their
    weights_digest when the caller already has it (not computed again)."""
    if recorded.startswith(DIGEST_PREFIX):
        return (digest or weights_digest(weights)) == recorded
    return sha256_digest(weights) == recorded


# Buffers this process shared, by key: a process cannot map its own CUDA IPC handle, so a snapshot opened where
# it was made (in-process actors: tests, benchmarks) reads the buffer itself.
_OWN: dict[int, torch.Tensor] = {}
# The buffer mapped from each other process, by its pid: (key, its slots as views). A learner shares one buffer for
# the whole run, so mapping it (cudaIpcOpenMemHandle) and making its views happens at the first load, not at every
# one; a new buffer of the same learner replaces the old mapping.
_MAPPED: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
_KEYS = itertools.count()  # a key is never reused in a process (an id() is, once its object is freed)


@dataclass(frozen=True)
class SharedWeights:
    """A published adapter left in the learner's GPU memory: the CUDA IPC handle of one flat buffer
    (torch.multiprocessing.reductions.reduce_tensor: a rebuild function and its arguments) and its layout.
    The buffer is the learner's and is rewritten at its next publish; a replica copies out of it at once."""

    handle: tuple[Any, tuple]
    layout: tuple[TensorSlot, ...]
    pid: int  # the process that owns the buffer
    key: int

    @classmethod
    def of(cls, flat: torch.Tensor, layout: tuple[TensorSlot, ...]) -> SharedWeights:
        from torch.multiprocessing.reductions import reduce_tensor

        key = next(_KEYS)
        _OWN[key] = flat
        return cls(reduce_tensor(flat), layout, os.getpid(), key)

    def open(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors as views of the mapped buffer (same GPU, another process)."""
        if self.pid == os.getpid():
            return slot_views(_OWN[self.key], self.layout)
        key, views = _MAPPED.get(self.pid, (None, {}))
        if key != self.key:
            rebuild, args = self.handle
            views = slot_views(rebuild(*args), self.layout)
            _MAPPED[self.pid] = (self.key, views)
        return views


@dataclass(frozen=True)
class ServedPolicy:
    """What a rollout replica reports after a refresh (RolloutWorker.serve): the name it received with the
    snapshot; the digest of the adapter as its serving path reads it, computed from its own buffers (None: the
    engine keeps a copy that cannot be read back, as vLLM does); the probe's log-probs, once per repeat (none
    when no probe was asked); and the seconds each part took on the replica's clock."""

    identity: PolicyIdentity
    digest: str | None
    probes: list[list[list[float]]]
    seconds: dict[str, float]


@dataclass
class PolicySnapshot:
    """What the learner publishes: its identity and the trainable weights, as CPU tensors (`weights`) or left
    on the learner's GPU (`shared`, with `weights` empty)."""

    identity: PolicyIdentity
    weights: dict[str, torch.Tensor]
    shared: SharedWeights | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter, wherever it travelled: CPU tensors, or views of the learner's mapped GPU buffer."""
        return self.weights if self.shared is None else self.shared.open()
