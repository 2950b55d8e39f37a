"""Strict sync: the controller proves what the rollout side serves, and every refusal path fires."""

from __future__ import annotations

import pytest
import torch

from miniverl.batches import PromptBatch, TeacherScores, concat_scores, stack_rows
from miniverl.errors import PolicyMismatchError
from miniverl.models.lora import LoraSettings
from miniverl.objectives.gkd import GkdObjective
from miniverl.policy import PolicyIdentity
from miniverl.process import ProcessSettings
from miniverl.rewards import ExactMatchReward
from miniverl.rollout.sampling import SamplingParams
from miniverl.step.controller import StrictSyncController, parts_holding
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
    assert first["probe_ran"] == 1 and first["probe_gap_max"] < 1e-4  # the run's first refresh probes
    assert second["probe_ran"] == 0 and "probe_gap_max" not in second  # proven by the served digest alone
    for key in ("loss", "reverse_kl", "accuracy", "reward", "time/refresh", "time/generate", "time/score"):
        assert key in first


def test_stale_rollout_worker_stops_the_run_before_any_update(parts, student_dir):
    _, prompts, learner, _ = parts
    ctl = make_controller(StaleRolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU), parts)
    ctl.step(prompts, PARAMS)  # v0: the first load is honest
    assert learner.version == 1
    with pytest.raises(PolicyMismatchError, match="serves an adapter whose digest .* is not that of the published v1"):
        ctl.step(prompts, PARAMS)
    assert learner.version == 1  # no second update happened


def test_the_learner_publishes_its_adapter_as_it_is_now(parts):
    """The adapter's tensors are found once (peft walks every module to find them), then published as they are at
    each publish; a parameter whose storage was replaced is found again, so the digest names what the model uses."""
    from miniverl.models.lora import live_adapter
    from miniverl.policy import weights_digest

    learner = parts[2]
    first = learner.publish_policy()
    outbox = learner.publisher._outbox
    with torch.no_grad():
        for p in learner.params:
            p.add_(0.01)
    second = learner.publish_policy()
    assert learner.publisher._outbox is outbox and second.identity.digest != first.identity.digest
    assert second.identity.digest == weights_digest(live_adapter(learner.model))
    with torch.no_grad():
        learner.params[0].data = learner.params[0].data + 0.5  # new storage under the same parameter
    third = learner.publish_policy()
    assert learner.publisher._outbox is not outbox and third.identity.digest == weights_digest(
        live_adapter(learner.model)
    )


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


def test_teacher_scores_go_from_scorer_to_learner_by_reference(parts, student_dir, monkeypatch):
    """The driver keeps ids, masks and rewards; the learner gets the scorer's own result (a Ray ref in a
    run), not a copy sliced in the driver (main: scorer -> driver -> learner, 97 MiB a step at the 4080
    recipe). The step's reverse KL comes from the learner, which holds the teacher's log-probs."""
    _, prompts, learner, scorer = parts
    ctl = make_controller(RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU), parts)
    returned, received = [], []
    score, update = scorer.score, learner.update
    monkeypatch.setattr(scorer, "score", lambda *a: returned.append(score(*a)) or returned[-1])
    monkeypatch.setattr(learner, "update", lambda batch, s, *a: received.append(s) or update(batch, s, *a))
    metrics = ctl.step(prompts, PARAMS)
    assert len(returned) == len(received) == 1 and received[0] is returned[0]
    assert metrics["reverse_kl"] > 0 and metrics["response_tokens"] > 0


def test_teacher_support_ids_travel_as_int32(parts, student_dir):
    _, prompts, learner, scorer = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    rollout.load_policy(learner.publish_policy())
    batch = rollout.generate(prompts, PARAMS)
    scores = scorer.score(batch, 4, 1.0)
    assert scores.teacher_topk_ids.dtype == torch.int32  # half of main's int64 bytes
    wide = scores.rows(0, len(batch))
    wide.teacher_topk_ids = wide.teacher_topk_ids.long()
    objective = GkdObjective(0.5, 1.0, 4)
    logits = torch.randn(*batch.responses.shape, 43)  # the tiny student's vocabulary
    assert torch.equal(objective.token_terms(logits, scores), objective.token_terms(logits, wide))


def test_row_slices_are_not_validated_again(parts, student_dir, monkeypatch):
    from miniverl.batches import RolloutBatch, TeacherScores

    _, prompts, learner, scorer = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    rollout.load_policy(learner.publish_policy())
    batch = rollout.generate(prompts, PARAMS)
    scores = scorer.score(batch, 4, 1.0)
    calls = []
    for cls in (RolloutBatch, TeacherScores):
        monkeypatch.setattr(cls, "__post_init__", lambda self: calls.append(self))
    part, part_scores = batch.rows(1, 3), scores.rows(1, 3)
    assert calls == [] and len(part) == 2 and torch.equal(part.responses, batch.responses[1:3])
    assert part.uid == batch.uid[1:3] and torch.equal(part_scores.teacher_topk_ids, scores.teacher_topk_ids[1:3])


def test_one_replicas_batch_goes_to_the_scorer_and_the_learner_by_reference(parts, student_dir, monkeypatch):
    """Issue 36, refs not copies: with one rollout replica, one scorer and one learner, the batch the replica
    returned (a Ray ref through Ray) is what the scorer and the learner receive, not the driver's stacked copy; with
    two scorers each gets its rows of the driver's batch."""
    tok, prompts, learner, scorer = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    seen: dict[str, list] = {"generate": [], "score": [], "update": []}
    for obj, name in ((rollout, "generate"), (scorer, "score"), (learner, "update")):
        method = getattr(type(obj), name)

        def spy(self, batch, *args, _method=method, _name=name):
            out = _method(self, batch, *args)
            seen[_name].append(out if _name == "generate" else batch)
            return out

        monkeypatch.setattr(type(obj), name, spy)
    make_controller(rollout, parts).step(prompts, PARAMS)
    assert seen["score"][0] is seen["generate"][0] and seen["update"][0] is seen["generate"][0]
    two = StrictSyncController(rollout, [scorer, scorer], learner, ExactMatchReward(tok), 0, 1.0)
    two.step(prompts, PARAMS)
    assert len(seen["score"]) == 3 and all(batch is not seen["generate"][1] for batch in seen["score"][1:])
    assert seen["update"][1] is seen["generate"][1]  # one learner still takes the replica's batch


def test_a_learner_rank_stacks_the_scorer_parts_that_hold_its_rows():
    """Scorer parts of rows 0-4, 4-6 and 6-8 and learner shards that cross them (or hold no rows): the parts a rank
    is sent (parts_holding), stacked and cut in the learner (stack_rows), are bit for bit its rows of the whole
    scores, what it trained on when the driver fetched and cut them."""
    g = torch.Generator().manual_seed(0)
    whole = TeacherScores(
        -torch.rand(8, 5, generator=g),
        -torch.rand(8, 5, 3, generator=g),
        torch.randint(0, 43, (8, 5, 3), generator=g, dtype=torch.int32),
        -torch.rand(8, 5, generator=g),
    )
    parts = [(whole.rows(a, b), a, b) for a, b in ((0, 4), (4, 6), (6, 8))]
    assert concat_scores([p for p, _, _ in parts]).teacher_topk_ids.equal(whole.teacher_topk_ids)
    for (a, b), holding in (((0, 4), [0]), ((2, 6), [0, 1]), ((4, 8), [1, 2]), ((0, 8), [0, 1, 2]), ((8, 8), [2])):
        sent = parts_holding(parts, a, b)
        assert sent == [parts[i] for i in holding]
        first = sent[0][1]
        got, want = stack_rows([p for p, _, _ in sent], a - first, b - first), whole.rows(a, b)
        for name in ("teacher_log_probs", "teacher_topk_logprobs", "teacher_topk_ids", "teacher_tail_logprob"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (a, b, name)
