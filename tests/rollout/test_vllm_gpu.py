"""vLLM backend on a real GPU with the real engine (no fakes): samples, stops, log-probs against the HF
oracle, both refresh modes, the probe, adapter cleanup and sleep/wake. Skipped without CUDA or vLLM.

The model is a small random-init Qwen2 (head dim 64, which vLLM's attention kernels support); its logits
are nearly uniform, so tokens are compared through teacher-forced log-probs, not sequence equality.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from lab.bench.oracle import logprob_gaps
from miniverl.models.lora import LoraSettings
from miniverl.rollout.hf_reference import HFReferenceBackend
from miniverl.rollout.sampling import SamplingParams, row_seeds
from miniverl.rollout.vllm_settings import VllmSettings
from tests.random_models import save_random_qwen2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm]')"),
]
LORA = LoraSettings(16, 32.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 0)
VOCAB = 2048
GAP_MEAN_MAX = 0.05  # bf16 vs bf16, the rollout bench's oracle rule
STOPS = tuple(range(100, 300))  # ~10% of the vocabulary: most rows stop within 64 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-model")
    save_random_qwen2(path, hidden_size=256, intermediate_size=512, vocab_size=VOCAB)
    return path


def settings(refresh: str, **kw) -> VllmSettings:
    base = dict(
        refresh=refresh,
        enforce_eager=False,
        engine_process="inprocess",
        seeding="row",
        max_num_seqs=64,
        cudagraph_capture_size=64,
        max_num_batched_tokens=0,
        max_model_len=256,
        enable_prefix_caching=True,
        async_scheduling=False,
        sleep_between_steps=False,
        gpu_share=0.2,
        gpu_cap_gib=None,
        kv_cache_gib=2.0,
        adapter_root="/dev/shm",
        quantization="none",
    )
    return VllmSettings(**(base | kw))


def adapter(template, seed: int, std: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * std for k, v in sorted(template.items())}


def prompts(k: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(300, VOCAB, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
        for _ in range(k)
    ]


@pytest.fixture(scope="module", params=["adapter", "merged"])
def engine(request, model_dir):
    from miniverl.rollout.vllm import VllmBackend

    backend = VllmBackend(str(model_dir), LORA, torch.bfloat16, "cuda", settings(request.param))
    oracle = HFReferenceBackend(str(model_dir), LORA, torch.bfloat16, "cuda")
    yield backend, oracle
    backend.close()


def test_samples_match_the_oracle_and_stop(engine):
    samples_match_the_oracle_and_stop(*engine)


def samples_match_the_oracle_and_stop(backend, oracle):
    """Shared with tests/rollout/test_sglang_gpu.py: any engine backend against the HF oracle."""
    weights = adapter(backend.adapter_weights(), 1)
    backend.load_adapter(weights)
    oracle.load_adapter(weights)
    ps = prompts(8)
    params = SamplingParams(n=4, max_new_tokens=64, temperature=1.0, stop_token_ids=STOPS)
    out = backend.generate(ps, params, row_seeds(3, 32))
    assert len(out) == 32
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        if c.finished:
            assert c.token_ids[-1] in STOPS and not set(c.token_ids[:-1]) & set(STOPS)
        else:
            assert len(c.token_ids) == 64 and not set(c.token_ids) & set(STOPS)
    assert sum(c.finished for c in out) >= 16
    gaps = logprob_gaps(oracle, ps, 4, out)
    assert float(gaps.mean()) < GAP_MEAN_MAX, float(gaps.mean())


def test_row_seeds_decide_samples(engine):
    row_seeds_decide_samples(engine[0])


def row_seeds_decide_samples(backend):
    ps = prompts(4)
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0)
    a = backend.generate(ps, params, row_seeds(5, 8))
    b = backend.generate(ps, params, row_seeds(5, 8))
    c = backend.generate(ps, params, row_seeds(6, 8))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_probe_follows_every_refresh(engine):
    backend, oracle = engine
    probe_follows_every_refresh(backend, oracle)
    if backend.store is not None:  # adapter mode: one adapter in the engine and one folder in /dev/shm
        assert backend.served_adapters() == [backend.version]
        assert backend.store.versions() == [f"v{backend.version}"]


def probe_follows_every_refresh(backend, oracle):
    seqs = prompts(6)
    seen = []
    for seed in (11, 12, 13):
        weights = adapter(backend.adapter_weights(), seed)
        backend.load_adapter(weights)
        oracle.load_adapter(weights)
        served = backend.probe_logprobs(seqs)
        assert [len(s) for s in served] == [len(s) - 1 for s in seqs]
        ref = [g.tolist() for g in _teacher_forced(oracle, seqs)]
        worst = max(abs(x - y) for s, r in zip(served, ref) for x, y in zip(s, r))
        assert worst < backend.probe_tolerance, worst
        seen.append(served)
    moved = max(abs(x - y) for s, r in zip(seen[0], seen[1]) for x, y in zip(s, r))
    assert moved > backend.probe_tolerance / 10


def _teacher_forced(oracle, seqs):
    from miniverl.models.logprobs import token_logprobs

    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], device="cuda")
            logits = oracle.model(input_ids=ids).logits[:, :-1]
            out.append(token_logprobs(logits, ids[:, 1:])[0].float().cpu())
    return out


def test_sleep_frees_memory_and_keeps_weights(model_dir):
    from miniverl.rollout.vllm import VllmBackend

    backend = VllmBackend(str(model_dir), LORA, torch.bfloat16, "cuda", settings("adapter", sleep_between_steps=True))
    try:
        backend.load_adapter(adapter(backend.adapter_weights(), 1))
        seqs = prompts(3)
        before = backend.probe_logprobs(seqs)
        free_awake = torch.cuda.mem_get_info()[0]
        backend.sleep()
        freed = torch.cuda.mem_get_info()[0] - free_awake
        after = backend.probe_logprobs(seqs)  # wakes
        assert freed > 1.5 * 2**30  # the 2 GiB KV cache at least
        assert max(abs(x - y) for s, r in zip(before, after) for x, y in zip(s, r)) < 1e-3
        print(f"sleep freed {freed / 2**30:.2f} GiB")
    finally:
        backend.close()
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
