"""The adapter left on the learner's GPU (miniverl/policy.py, SharedWeights): another process maps the buffer by
its CUDA IPC handle, pickled as Ray pickles it, and reads exactly the learner's bytes, also after the learner
rewrote them in place. Skipped without CUDA."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
import torch

from miniverl.policy import SharedWeights, flat_digest, flat_layout, pack, weights_digest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _replica(conn) -> None:
    """Another process on the same GPU: open each snapshot it is sent, digest what it reads, copy it out."""
    while (payload := conn.recv()) is not None:
        weights = pickle.loads(payload).open()
        own = {k: v.clone() for k, v in weights.items()}  # device to device, as a replica loads it
        torch.cuda.synchronize()
        conn.send((weights_digest(own), {k: v.cpu() for k, v in own.items()}))


def test_a_replica_process_reads_the_learners_buffer_exactly_after_every_rewrite():
    g = torch.Generator().manual_seed(0)
    adapter = {
        f"layers.{i}.{kind}": torch.randn(shape, generator=g).to("cuda", dtype)
        for i in range(3)
        for kind, shape, dtype in (("lora_A", (8, 64), torch.float32), ("lora_B", (96, 8), torch.bfloat16))
    }
    layout = flat_layout(adapter)
    flat = pack(adapter, layout)
    shared = SharedWeights.of(flat, layout)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_replica, args=(there,))
    child.start()
    try:
        for version in range(3):
            if version:
                for t in adapter.values():
                    t.add_(0.5)  # the optimizer's in-place step
                pack(adapter, layout, out=flat)  # the same buffer, rewritten
            published = flat_digest(flat, layout)
            assert published == weights_digest(adapter)
            here.send(pickle.dumps(shared))
            digest, read = here.recv()
            assert digest == published, version
            for name, t in adapter.items():
                assert torch.equal(read[name], t.cpu()), (version, name)
        here.send(None)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
