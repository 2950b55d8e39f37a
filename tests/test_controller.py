"""Strict sync: the controller proves what the rollout side serves, and every refusal path fires."""

from __future__ import annotations

import pytest
import torch

from miniverl.controller import StrictSyncController
from miniverl.models.lora import LoraSettings
from miniverl.objectives.gkd import GkdObjective
from miniverl.protocol import PolicyIdentity, PolicyMismatchError, PromptBatch
from miniverl.rewards import ExactMatchReward
from miniverl.rollout.sampling import SamplingParams
from miniverl.workers import ProcessSettings
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0)
CPU = ProcessSettings("cpu", torch_threads=1)  # see conftest: one thread for tiny models
PARAMS = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=(2,))


class StaleRolloutWorker(RolloutWorker):
    """Acknowledges every snapshot under its published name but keeps serving the weights it loaded first."""

    def load_policy(self, snapshot):
        if self.served is None:
            return super().load_policy(snapshot)
        self.served = snapshot.identity
        return self.served


@pytest.fixture()
def parts(student_dir, teacher_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    prompts = PromptBatch([tok("abc>")["input_ids"], tok("de>")["input_ids"]], ["p0", "p1"], ["cba", "ed"])
    learner = LearnerWorker(str(student_dir), LORA, "float32", GkdObjective(0.5, 1.0, 0), 5e-2, 0.0, 1.0, 2, CPU)
    scorer = ScorerWorker(str(teacher_dir), "float32", 4, CPU)
    return tok, prompts, learner, scorer


def make_controller(rollout, parts):
    tok, _, learner, scorer = parts
    return StrictSyncController(
        rollout, scorer, learner, ExactMatchReward(tok), teacher_support_k=0, loss_temperature=1.0
    )


def test_steps_advance_the_version_and_the_served_digest(parts, student_dir):
    _, prompts, learner, _ = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    ctl = make_controller(rollout, parts)
    first = ctl.step(prompts, PARAMS)
    digest_1 = rollout.served.digest
    second = ctl.step(prompts, PARAMS)
    assert (first["policy_version"], second["policy_version"]) == (0, 1)
    assert learner.version == 2
    assert rollout.served.version == 1 and rollout.served.digest != digest_1  # the update changed the weights
    assert second["sampler_gap_mean"] < 1e-4  # same fp32 weights on both sides
    assert second["probe_gap_max"] < 1e-4 and second["probe_learner_moved"] > 0
    for key in ("loss", "reverse_kl", "accuracy", "reward", "time/refresh", "time/generate", "time/score"):
        assert key in first


def test_stale_rollout_worker_stops_the_run_before_any_update(parts, student_dir):
    _, prompts, learner, _ = parts
    ctl = make_controller(StaleRolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU), parts)
    ctl.step(prompts, PARAMS)  # v0: the first load is honest
    assert learner.version == 1
    with pytest.raises(PolicyMismatchError, match="serves probe log-probs up to"):
        ctl.step(prompts, PARAMS)
    assert learner.version == 1  # no second update happened


def test_learner_refuses_batches_of_another_version(parts, student_dir):
    _, prompts, learner, scorer = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    rollout.load_policy(learner.publish_policy())
    batch = rollout.generate(prompts, PARAMS)
    scores = scorer.score(batch, 0, 1.0)
    learner.update(batch, scores, None)  # v0 batch, learner at v0: accepted
    learner.publish_policy()
    with pytest.raises(PolicyMismatchError, match="sampled by v0"):
        learner.update(batch, scores, None)  # the same v0 batch again: refused
    assert learner.version == 1


def test_learner_refuses_before_publishing(parts, student_dir):
    _, prompts, learner, scorer = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    with pytest.raises(PolicyMismatchError, match="load_policy"):
        rollout.generate(prompts, PARAMS)
    rollout.load_policy(learner.publish_policy())
    batch = rollout.generate(prompts, PARAMS)
    fresh = LearnerWorker(str(student_dir), LORA, "float32", GkdObjective(0.5, 1.0, 0), 1e-3, 0.0, 1.0, 2, CPU)
    with pytest.raises(PolicyMismatchError, match="published: nothing"):
        fresh.update(batch, scorer.score(batch, 0, 1.0), None)


def test_rollouts_stamped_with_another_version_are_refused(parts, student_dir):
    _, prompts, _, _ = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    ctl = make_controller(rollout, parts)
    identity = ctl.ensure_served()
    with pytest.raises(PolicyMismatchError, match="stamped"):
        ctl.sample(prompts, PARAMS, PolicyIdentity(identity.version + 1, identity.digest))


def test_rollout_batch_layout(parts, student_dir):
    tok, prompts, learner, _ = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    rollout.load_policy(learner.publish_policy())
    batch = rollout.generate(prompts, SamplingParams(n=3, max_new_tokens=5, stop_token_ids=(tok.eos_token_id,)))
    assert batch.uid == ["p0"] * 3 + ["p1"] * 3
    assert batch.prompt_mask[3:].sum(1).tolist() == [len(prompts.prompt_ids[1])] * 3  # shorter prompt, left pad
    for row in range(6):
        n = int(batch.response_mask[row].sum())
        ended = batch.responses[row, n - 1].item() == tok.eos_token_id
        assert bool(batch.finished[row]) == ended  # EOS is kept inside the mask
        assert ended or n == 5
        assert torch.all(batch.rollout_log_probs[row, :n] < 0)
