"""The policy's name and how its weights travel (miniverl/policy.py): the fingerprint digest, flat packing, the
legacy SHA-256 digests of old checkpoints, and the snapshot's two transports (the GPU one: test_policy_gpu.py)."""

from __future__ import annotations

import torch

from miniverl import policy
from miniverl.policy import (
    DIGEST_PREFIX,
    FlatCopy,
    PolicyIdentity,
    PolicySnapshot,
    digest_matches,
    flat_digest,
    flat_layout,
    layout_bytes,
    pack,
    sha256_digest,
    slot_views,
    weights_digest,
)


def adapter(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.1.lora_B": torch.randn(5, 3, generator=g),  # 60 bytes: the next slot starts padded
        "layer.0.lora_A": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "odd": torch.randn(1, generator=g).to(torch.float16),
    }


def test_pack_round_trips_every_dtype_and_aligns_each_slot():
    w = adapter()
    layout = flat_layout(w)
    assert [s.name for s in layout] == sorted(w)
    assert all(s.offset % policy.ALIGN == 0 for s in layout)
    flat = pack(w, layout)
    assert flat.dtype == torch.uint8 and flat.numel() == layout_bytes(layout)
    views = slot_views(flat, layout)
    for name, t in w.items():
        assert views[name].dtype == t.dtype and views[name].shape == t.shape
        assert torch.equal(views[name], t), name
    pack(adapter(1), layout, out=flat)  # rewritten in place: the same buffer holds the new weights
    assert torch.equal(slot_views(flat, layout)["layer.1.lora_B"], adapter(1)["layer.1.lora_B"])


def test_digest_sees_one_flipped_bit_in_any_tensor():
    w = adapter()
    d = weights_digest(w)
    assert d.startswith(DIGEST_PREFIX) and d == weights_digest({k: v.clone() for k, v in w.items()})
    for name, t in w.items():
        bumped = t.clone()
        bumped.view(-1).view(torch.uint8 if t.element_size() == 1 else torch.int16)[0] ^= 1
        assert weights_digest({**w, name: bumped}) != d, name
    swapped = {**w, "layer.1.lora_B": w["layer.1.lora_B"].flip(0)}  # same values, other positions
    assert weights_digest(swapped) != d


def test_digest_does_not_depend_on_how_the_buffer_is_chunked(monkeypatch):
    w = {"big": torch.randn(3001)}
    d = weights_digest(w)
    monkeypatch.setattr(policy, "CHUNK", 7)
    assert weights_digest(w) == d


def _fingerprint_by_definition(flat: torch.Tensor) -> list[int]:
    """fp1 as written down: every word weighed by its position, in Python integers (no overflow, no shortcut)."""
    words = flat.view(torch.int16).tolist()
    return [
        sum((w + 32768) * ((i * mul + add) % period + 1) for i, w in enumerate(words)) % policy.MODULUS
        for mul, add, period in policy.WEIGHTS
    ]


def test_the_column_sums_give_the_fingerprint_as_defined(monkeypatch):
    """Buffers shorter than a period, ending on and just past a row, and (small passes) several passes and
    flushes: the same two sums as weighing every word."""
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(policy, "CHUNK", 2 * 65521)  # two rows per reduction
    monkeypatch.setattr(policy, "FLUSH_ROWS", 3)
    for words in (8, 65519, 65521, 65521 * 5 + 8, 65519 * 7 + 24):
        flat = torch.randint(0, 256, (2 * words,), dtype=torch.uint8, generator=g)
        assert policy._fingerprint(flat) == _fingerprint_by_definition(flat), words


def test_the_fingerprint_of_a_fixed_buffer_never_changes():
    """Checkpoints record fp1 digests: a faster computation must give the numbers the first one gave."""
    flat = ((torch.arange(300_000, dtype=torch.int64) * 7 + 3) % 251).to(torch.uint8)
    assert policy._fingerprint(flat) == [161079333043186, 161079164764606]


def test_flat_digest_of_the_published_buffer_is_the_weights_digest():
    w = adapter()
    layout = flat_layout(w)
    assert flat_digest(pack(w, layout), layout) == weights_digest(w)


def test_checkpoints_recorded_with_the_old_sha256_digest_still_match():
    w = adapter()
    legacy = sha256_digest(w)
    assert not legacy.startswith(DIGEST_PREFIX) and len(legacy) == 64
    assert digest_matches(w, legacy) and digest_matches(w, weights_digest(w))
    assert digest_matches(w, weights_digest(w), weights_digest(w))  # a digest the caller already has
    other = adapter(1)
    assert not digest_matches(other, legacy) and not digest_matches(other, weights_digest(w))


def test_a_host_snapshot_hands_over_its_cpu_tensors():
    w = adapter()
    snap = PolicySnapshot(PolicyIdentity(3, weights_digest(w)), w)
    assert snap.shared is None and snap.tensors() is w
    assert snap.identity.short() == f"v3:{snap.identity.digest[len(DIGEST_PREFIX) :][:12]}"


def test_a_flat_copy_follows_its_tensors_written_in_place():
    w = adapter()
    out = FlatCopy(w)
    assert out.digest() == weights_digest(w)
    w["layer.1.lora_B"].add_(1.0)  # the optimizer's in-place step
    assert out.digest() == weights_digest(w) != weights_digest(adapter())
    assert torch.equal(slot_views(out.flat, out.layout)["layer.1.lora_B"], w["layer.1.lora_B"])
    copies = out.cpu_copies()
    assert all(torch.equal(copies[k], v) and copies[k].data_ptr() != v.data_ptr() for k, v in w.items())
