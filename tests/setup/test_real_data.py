"""A user's setup end to end on the CPU: instruct-style models with a chat template, several EOS ids and
differently padded vocabularies, GSM8K-format parquet, per-source rewards and evaluation."""

from __future__ import annotations

import pytest
import torch

from miniverl.errors import ConfigError
from miniverl.models.lora import LoraSettings
from miniverl.models.stops import stop_token_ids
from miniverl.objectives.gkd import GkdObjective
from miniverl.process import ProcessSettings
from miniverl.rollout.sampling import SamplingParams
from miniverl.setup.prepare import prepare
from miniverl.step.controller import StrictSyncController
from miniverl.step.evaluation import accuracy_by_source, evaluate
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from tests.chat_models import gsm8k_rows, write_parquet
from tests.conftest import CHAT_STUDENT_VOCAB, CHAT_TEACHER_VOCAB
from tests.test_config import load

CPU = ProcessSettings("cpu")
LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0)


def user_config(student, teacher, train, *overrides):
    return load(
        f"model.student.path={student}",
        f"model.teacher.path={teacher}",
        f"data.train_files=[{train}]",
        "data.max_prompt_length=200",
        "data.prompts_per_step=2",
        "data.eval_prompts=3",
        "trainer.total_steps=3",
        *overrides,
    )


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("data") / "gsm8k.parquet", gsm8k_rows(12))


def test_prepare_a_users_parquet_run(chat_student_dir, chat_teacher_dir, parquet):
    logs = []
    setup = prepare(user_config(chat_student_dir, chat_teacher_dir, parquet), log=logs.append)
    tok = setup.tokenizer
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert setup.stop_token_ids == (im_end, endoftext)  # the tokenizer's EOS and generation_config's list
    assert setup.vocab_size == CHAT_STUDENT_VOCAB  # the teacher's extra padded logits are dropped
    batch = setup.prompts.batch(0, 2)
    assert tok.decode(batch.prompt_ids[0]).endswith("<|im_start|>assistant\n")
    assert batch.data_source == ["openai/gsm8k"] * 2 and setup.eval_batch.data_source == ["openai/gsm8k"] * 3
    assert any("9 training and 3 evaluation prompts (verl schema, chat template)" in line for line in logs)


def test_extra_stop_ids_and_bad_ones():
    assert stop_token_ids(2, [2, 0], [7], 10) == (2, 0, 7)
    with pytest.raises(ConfigError, match="set rollout.stop_token_ids"):
        stop_token_ids(None, [], [], 10)
    with pytest.raises(ConfigError, match=r"stop ids \[12\] are outside .* 10 logits; fix rollout.stop_token_ids"):
        stop_token_ids(2, [], [12], 10)


def test_teacher_with_fewer_logits_than_the_student_is_refused(chat_student_dir, chat_teacher_dir, parquet):
    with pytest.raises(ConfigError, match=r"teacher outputs 320 logits and the student 352"):
        prepare(user_config(chat_teacher_dir, chat_student_dir, parquet))


def test_unknown_source_fails_before_training(chat_student_dir, chat_teacher_dir, tmp_path):
    mine = write_parquet(tmp_path / "mine.parquet", gsm8k_rows(8, source="my/set"))
    with pytest.raises(Exception, match="no reward for data_source 'my/set'"):
        prepare(user_config(chat_student_dir, chat_teacher_dir, mine))
    prepare(user_config(chat_student_dir, chat_teacher_dir, mine, "reward.name=gsm8k"))


@pytest.mark.parametrize("topk", [0, 8])
def test_distil_over_the_shared_vocabulary_range(chat_student_dir, chat_teacher_dir, parquet, topk):
    """One GKD step between models of 320 and 352 logits: the scorer cuts the teacher to 320 and
    renormalizes, so the support the learner receives is a distribution over the student's range."""
    setup = prepare(user_config(chat_student_dir, chat_teacher_dir, parquet))
    student, teacher = str(chat_student_dir), str(chat_teacher_dir)
    objective = GkdObjective(beta=0.5, loss_temperature=1.0, teacher_topk=topk)
    rollout = RolloutWorker("hf_reference", student, LORA, "float32", CPU)
    scorer = ScorerWorker(teacher, "float32", 4, CPU, vocab_size=setup.vocab_size)
    learner = LearnerWorker(student, LORA, "float32", objective, 1e-3, 0.0, 1.0, 4, CPU)
    ctl = StrictSyncController(rollout, scorer, learner, setup.reward_fn, topk, 1.0)
    params = SamplingParams(2, 6, 1.0, stop_token_ids=setup.stop_token_ids, seed=3)
    identity = ctl.ensure_served()
    rollouts = ctl.sample(setup.prompts.batch(0, 2), params, identity)
    assert rollouts.data_source == ["openai/gsm8k"] * 4
    parts = ctl.score(rollouts, topk)
    scores = ctl.fetch_scores(parts)
    if topk == 0:
        assert scores.teacher_topk_logprobs.shape[-1] == CHAT_STUDENT_VOCAB
        total = scores.teacher_topk_logprobs.logsumexp(-1)
        assert torch.allclose(total, torch.zeros_like(total), atol=1e-5)
    full = ScorerWorker(teacher, "float32", 4, CPU)  # without the cut: the teacher's own 352 logits
    assert full.score(rollouts, 0, 1.0).teacher_topk_logprobs.shape[-1] == CHAT_TEACHER_VOCAB
    metrics = ctl.update(rollouts, parts, setup.reward_fn(rollouts))
    assert torch.isfinite(torch.tensor(metrics["loss"])) and learner.version == 1


def test_evaluation_reports_per_source_accuracy_and_samples(chat_student_dir, chat_teacher_dir, parquet):
    setup = prepare(user_config(chat_student_dir, chat_teacher_dir, parquet))
    student = str(chat_student_dir)
    rollout = RolloutWorker("hf_reference", student, LORA, "float32", CPU)
    scorer = ScorerWorker(str(chat_teacher_dir), "float32", 4, CPU, vocab_size=setup.vocab_size)
    learner = LearnerWorker(student, LORA, "float32", GkdObjective(0.5, 1.0, 0), 1e-3, 0.0, 1.0, 4, CPU)
    ctl = StrictSyncController(rollout, scorer, learner, setup.reward_fn, 0, 1.0)
    result = evaluate(ctl, setup.eval_batch, 5, setup.stop_token_ids, 0, setup.reward_fn, setup.tokenizer, 2)
    m = result.metrics
    for key in ("eval/accuracy", "eval/accuracy/openai/gsm8k", "eval/reverse_kl", "eval/response_length"):
        assert key in m
    assert 1 <= m["eval/response_length"] <= 5 and torch.isfinite(torch.tensor(m["eval/reverse_kl"]))
    assert len(result.samples) == 2 and result.samples[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert set(result.samples[0]) == {"data_source", "prompt", "response", "ground_truth", "reward", "finished"}


def test_accuracy_by_source():
    got = accuracy_by_source(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["a", "b", "a", "b"])
    assert got == {"eval/accuracy/a": 1.0, "eval/accuracy/b": 0.5}


def test_configured_stop_ids_reach_the_sampler(chat_student_dir, chat_teacher_dir, parquet):
    """rollout.stop_token_ids travels config -> Setup -> SamplingParams -> backend: declaring the token
    greedy decoding emits first as a stop id ends that row after one token, marked finished."""
    student = str(chat_student_dir)
    setup = prepare(user_config(chat_student_dir, chat_teacher_dir, parquet))
    learner = LearnerWorker(student, LORA, "float32", GkdObjective(0.5, 1.0, 0), 1e-3, 0.0, 1.0, 4, CPU)
    rollout = RolloutWorker("hf_reference", student, LORA, "float32", CPU)
    rollout.load_policy(learner.publish_policy())
    prompts = setup.prompts.batch(0, 2)
    free = rollout.generate(prompts, SamplingParams(1, 4, 0.0, stop_token_ids=setup.stop_token_ids))
    first = int(free.responses[0, 0])
    assert first not in setup.stop_token_ids and not free.finished[0] and int(free.response_mask[0].sum()) == 4
    stopped_setup = prepare(
        user_config(chat_student_dir, chat_teacher_dir, parquet, f"rollout.stop_token_ids=[{first}]")
    )
    assert stopped_setup.stop_token_ids == (*setup.stop_token_ids, first)
    stopped = rollout.generate(prompts, SamplingParams(1, 4, 0.0, stop_token_ids=stopped_setup.stop_token_ids))
    assert bool(stopped.finished[0]) and int(stopped.response_mask[0].sum()) == 1
