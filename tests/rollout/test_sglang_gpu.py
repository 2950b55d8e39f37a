"""The SGLang backend on a real GPU with the real engine (issue 37): samples, stops and log-probs against the HF
oracle, row seeds, the probe after every refresh, and strict sync catching a replica that keeps serving an old
adapter. Skipped without CUDA or sglang (0.5.17 is the release written against: docs/benchmarks/sglang-feasibility.md).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miniverl.batches import PromptBatch
from miniverl.bench.oracle import logprob_gaps
from miniverl.errors import PolicyMismatchError
from miniverl.objectives.gkd import GkdObjective
from miniverl.process import ProcessSettings
from miniverl.rollout.hf_reference import HFReferenceBackend
from miniverl.rollout.sampling import SamplingParams, row_seeds
from miniverl.rollout.sglang import SglangSettings
from miniverl.step.controller import StrictSyncController
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from tests.random_models import save_random_qwen2
from tests.rollout.test_vllm_gpu import GAP_MEAN_MAX, LORA, STOPS, VOCAB, _teacher_forced, adapter, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang (0.5.17)"),
]
GPU = ProcessSettings("cuda")
SETTINGS = SglangSettings("triton", "pytorch", None, 64, 256, 0.2, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sglang-model")
    save_random_qwen2(path, hidden_size=256, intermediate_size=512, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    from miniverl.rollout.sglang import SglangBackend

    backend = SglangBackend(str(model_dir), LORA, torch.bfloat16, "cuda", SETTINGS)
    oracle = HFReferenceBackend(str(model_dir), LORA, torch.bfloat16, "cuda")
    yield backend, oracle
    backend.close()


def test_samples_match_the_oracle_and_stop(engine):
    backend, oracle = engine
    weights = adapter(backend.adapter_weights(), 1)
    backend.load_adapter(weights)
    oracle.load_adapter(weights)
    ps = prompts(8)
    out = backend.generate(ps, SamplingParams(n=4, max_new_tokens=64, stop_token_ids=STOPS), row_seeds(3, 32))
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
    backend, _ = engine
    ps = prompts(4)
    params = SamplingParams(n=2, max_new_tokens=16)
    a = backend.generate(ps, params, row_seeds(5, 8))
    b = backend.generate(ps, params, row_seeds(5, 8))
    c = backend.generate(ps, params, row_seeds(6, 8))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_probe_follows_every_refresh(engine):
    backend, oracle = engine
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


class FreezingWorker(RolloutWorker):
    """Honest until `freeze()`: then it acknowledges every snapshot but keeps serving the adapter it holds."""

    frozen = False

    def load_policy(self, snapshot):
        if not self.frozen:
            return super().load_policy(snapshot)
        self.served = snapshot.identity
        return self.served


def test_a_stale_sglang_replica_is_caught_at_its_first_stale_refresh(model_dir, engine):
    engine[0].close()  # one engine on the card at a time
    rollout = FreezingWorker("sglang", str(model_dir), LORA, "bfloat16", GPU, {"settings": SETTINGS})
    try:
        path = str(model_dir)
        learner = LearnerWorker(path, LORA, "bfloat16", GkdObjective(0.5, 1.0, 0), 2e-4, 0.0, 1.0, 8, GPU)
        ctl = StrictSyncController(
            rollout, ScorerWorker(path, "bfloat16", 8, GPU), learner, lambda b: torch.zeros(len(b)), 0, 1.0
        )
        batch = PromptBatch(prompts(4), [f"p{i}" for i in range(4)], [""] * 4)
        params = SamplingParams(n=2, max_new_tokens=16, seed=5)
        ctl.step(batch, params)  # v0 served honestly
        rollout.frozen = True
        with pytest.raises(PolicyMismatchError, match="rollout replica 0 serves"):
            ctl.step(batch, params)  # v1 acknowledged, v0 served
        assert learner.version == 1  # not one update on stale samples
    finally:
        rollout.backend.close()
