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
from miniverl.rollout.sampling import SamplingParams
from miniverl.step.controller import StrictSyncController
from miniverl.workers import ProcessSettings
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from tests.random_models import save_random_qwen2
from tests.rollout.test_vllm_gpu import LORA, prompts, settings
from tests.step.test_controller import StaleRolloutWorker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm]')"),
]
GPU = ProcessSettings("cuda")
PARAMS = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sync-vllm-model")
    save_random_qwen2(path, hidden_size=256, intermediate_size=512, vocab_size=2048)
    return path


def controller(model_dir, rollout_cls):
    learner = LearnerWorker(str(model_dir), LORA, "bfloat16", GkdObjective(0.5, 1.0, 0), 2e-4, 0.0, 1.0, 8, GPU)
    scorer = ScorerWorker(str(model_dir), "bfloat16", 8, GPU)
    rollout = rollout_cls("vllm", str(model_dir), LORA, "bfloat16", GPU, {"settings": settings("adapter")})
    ctl = StrictSyncController(rollout, scorer, learner, lambda batch: torch.zeros(len(batch)), 0, 1.0)
    batch = PromptBatch(prompts(4), [f"p{i}" for i in range(4)], [""] * 4)
    return ctl, learner, rollout, batch


def test_a_stale_vllm_replica_is_caught_at_its_first_stale_refresh(model_dir):
    ctl, learner, rollout, batch = controller(model_dir, StaleRolloutWorker)
    try:
        ctl.step(batch, PARAMS)  # v0: the first load is honest
        assert ctl.sync.on_device  # one GPU: the adapter went device to device
        with pytest.raises(PolicyMismatchError, match="rollout replica 0 serves"):
            ctl.step(batch, PARAMS)  # v1 acknowledged, v0 served
        assert learner.version == 1  # not one update on stale samples
    finally:
        rollout.backend.close()


def test_an_honest_vllm_replica_is_not_flagged(model_dir):
    ctl, learner, rollout, batch = controller(model_dir, RolloutWorker)
    try:
        moved = [ctl.step(batch, PARAMS)["probe_learner_moved"] for _ in range(4)]
        assert learner.version == 4 and ctl.sync.refreshes == 4
        assert all(m > 0 for m in moved[1:])
    finally:
        rollout.backend.close()
