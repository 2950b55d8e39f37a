"""Strict sync against a real vLLM engine in bf16 (issue 16): a replica that acknowledges every refresh but keeps
serving the first adapter is caught at its first stale refresh by the change test, and an honest one is not
flagged. The learner's adapter reaches the engine through the device path (miniverl/policy.py) when they share
the GPU. Skipped without CUDA or vLLM."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miniverl.batches import PromptBatch
from miniverl.errors import PolicyMismatchError
from miniverl.objectives.gkd import GkdObjective
from miniverl.process import ProcessSettings
from miniverl.rollout.sampling import SamplingParams
from miniverl.step.controller import StrictSyncController
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from tests.random_models import save_random_qwen2
from tests.rollout.test_vllm_gpu import LORA, prompts, settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm]')"),
]
GPU = ProcessSettings("cuda")
PARAMS = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=5)


class FreezingWorker(RolloutWorker):
    """An honest replica until `freeze()`: from the load after that one it acknowledges every snapshot under
    its published name but keeps serving what it holds (StaleRolloutWorker, switchable, so the two tests share
    one engine: each vLLM start costs 35-90 s)."""

    frozen = None  # None: honest; else the number of loads still honest

    def freeze(self, honest_loads: int = 1) -> None:
        self.frozen = honest_loads

    def load_policy(self, snapshot):
        if self.frozen is None or self.frozen > 0:
            self.frozen = None if self.frozen is None else self.frozen - 1
            return super().load_policy(snapshot)
        self.served = snapshot.identity
        return self.served


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    path = tmp_path_factory.mktemp("sync-vllm-model")
    save_random_qwen2(path, hidden_size=256, intermediate_size=512, vocab_size=2048)
    worker = FreezingWorker("vllm", str(path), LORA, "bfloat16", GPU, {"settings": settings("adapter")})
    worker.path = path
    yield worker
    worker.backend.close()


def controller(rollout):
    path = str(rollout.path)
    learner = LearnerWorker(path, LORA, "bfloat16", GkdObjective(0.5, 1.0, 0), 2e-4, 0.0, 1.0, 8, GPU)
    scorer = ScorerWorker(path, "bfloat16", 8, GPU)
    ctl = StrictSyncController(rollout, scorer, learner, lambda batch: torch.zeros(len(batch)), 0, 1.0)
    batch = PromptBatch(prompts(4), [f"p{i}" for i in range(4)], [""] * 4)
    return ctl, learner, batch


def test_an_honest_vllm_replica_is_not_flagged(rollout):
    ctl, learner, batch = controller(rollout)
    moved = [ctl.step(batch, PARAMS)["probe_learner_moved"] for _ in range(4)]
    assert ctl.sync.on_device  # one GPU: the adapter went device to device
    assert learner.version == 4 and ctl.sync.refreshes == 4
    assert all(m > 0 for m in moved[1:])


def test_a_stale_vllm_replica_is_caught_at_its_first_stale_refresh(rollout):
    ctl, learner, batch = controller(rollout)  # a fresh learner at v0
    rollout.freeze()
    ctl.step(batch, PARAMS)  # v0: the first load is honest
    with pytest.raises(PolicyMismatchError, match="rollout replica 0 serves"):
        ctl.step(batch, PARAMS)  # v1 acknowledged, v0 served
    assert learner.version == 1  # not one update on stale samples
