"""The built-in chat task (addition_chat) and the teacher's privileged context: solved demonstrations in the
teacher's prompt only, carried with the rollout to the scorer, the responses aligned token for token."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from miniverl.batches import concat_rollouts
from miniverl.config import validate
from miniverl.data.prompts import PromptSource, held_out_prompts
from miniverl.data.tasks import addition_chat_task
from miniverl.errors import ConfigError
from miniverl.models.loading import load_tokenizer
from miniverl.process import ProcessSettings
from miniverl.setup.prepare import prepare
from miniverl.workers.rollout import to_rollout_batch
from miniverl.workers.scorer import ScorerWorker
from tests.test_config import load


@pytest.fixture(scope="module")
def tok(chat_student_dir):
    return load_tokenizer(str(chat_student_dir))


def test_addition_chat_draws_numbers_of_the_asked_digits():
    rng = random.Random(0)
    for _ in range(200):
        ex = addition_chat_task(rng, 2, 2)
        a, b = (int(x) for x in ex.prompt.removeprefix("What is ").split("?")[0].split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and ex.answer == str(a + b)
        assert ex.solution == f"{a} + {b} = {a + b}"


def test_chat_prompts_use_the_template_and_teacher_prompts_hold_demonstrations(tok):
    source = PromptSource("addition_chat", 2, 2, tok, 400, 0, held_out=20, teacher_demonstrations=3)
    batch = source.batch(0, 4)
    held_out = held_out_prompts("addition_chat", 2, 2, 0, 20)
    for ids, teacher, answer in zip(batch.prompt_ids, batch.teacher_prompt_ids, batch.ground_truth):
        student_text, teacher_text = tok.decode(ids), tok.decode(teacher)
        question = student_text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert student_text.endswith("<|im_start|>assistant\n") and teacher_text.endswith(student_text[-40:])
        demos = teacher_text.split("<|im_start|>user\n")[1:-1]  # the solved turns before the question
        assert len(demos) == 3 and teacher_text.count("<|im_start|>assistant\n") == 4
        shown = [d.split("<|im_end|>")[0] for d in demos]
        assert question not in shown and not set(shown) & held_out  # never the row itself, never held out
        assert " = " in demos[0] and answer not in student_text
    assert source.batch(0, 4) == batch  # deterministic per (seed, step)
    assert source.batch(1, 4).teacher_prompt_ids != batch.teacher_prompt_ids
    assert "3 solved demonstrations" in source.describe()
    assert PromptSource("addition_chat", 2, 2, tok, 400, 0).batch(0, 4).teacher_prompt_ids is None


def test_a_teacher_prompt_over_the_budget_is_refused_with_its_length(tok):
    source = PromptSource("addition_chat", 2, 2, tok, 120, 0, teacher_demonstrations=8)
    with pytest.raises(ConfigError, match=r"the teacher prompt of s0-0 has \d+ tokens, more than data.max_prompt_len"):
        source.batch(0, 2)


def test_demonstrations_need_a_chat_task(tok, chat_student_dir):
    with pytest.raises(ConfigError, match="data.teacher_demonstrations=2 needs a chat task"):
        PromptSource("addition", 2, 2, tok, 100, 0, teacher_demonstrations=2)
    with pytest.raises(ConfigError, match="draws solved examples from a built-in chat task"):
        validate(load("data.teacher_demonstrations=2"))  # data.task=reverse
    with pytest.raises(ConfigError, match="is a chat task for instruct models, but model.student.path=builtin"):
        prepare(load("data.task=addition_chat"), log=lambda *_: None)  # before any built-in model is built
    with pytest.raises(ConfigError, match="mixes chat tasks"):
        validate(load("data.task=addition_chat+sort", f"model.student.path={chat_student_dir}"))


def rollouts_of(batch, n=2, tr=3):
    """A RolloutBatch of `batch` with fixed responses (n per prompt)."""
    from miniverl.rollout import Completion

    completions = [Completion([5 + i, 6, 7][: 1 + i % tr], [-0.5] * (1 + i % tr), True) for i in range(len(batch) * n)]
    return to_rollout_batch(batch, completions, n, 0)


def test_teacher_prompts_travel_with_the_rollout(tok):
    batch = PromptSource("addition_chat", 2, 2, tok, 400, 0, teacher_demonstrations=2).batch(0, 3)
    rollouts = rollouts_of(batch)
    view = rollouts.teacher_view()
    for row in range(len(rollouts)):
        ids = view.prompts[row][view.prompt_mask[row].bool()].tolist()
        assert ids == batch.teacher_prompt_ids[row // 2]
    assert torch.equal(view.responses, rollouts.responses) and view.uid == rollouts.uid
    again = pickle.loads(pickle.dumps(rollouts))  # int32 / bool in transit, long again on arrival
    assert torch.equal(again.teacher_prompts, rollouts.teacher_prompts) and again.teacher_prompts.dtype == torch.long
    part = rollouts.rows(2, 4)
    assert torch.equal(part.teacher_view().prompts, view.prompts[2:4])
    picked = rollouts.select([0, 1])
    assert torch.equal(picked.teacher_prompt_mask, rollouts.teacher_prompt_mask[:2])
    stacked = concat_rollouts([rollouts.rows(0, 2), rollouts.rows(2, 6)])
    assert torch.equal(stacked.teacher_view().input_ids, view.input_ids)
    assert rollouts_of(PromptSource("addition_chat", 2, 2, tok, 400, 0).batch(0, 3)).teacher_view().prompts.shape[1]


def test_the_scorer_scores_the_responses_after_the_teacher_prompt(tok, chat_teacher_dir):
    """Scores of a batch with teacher prompts equal the scores of the same responses after those prompts given as
    the batch's own prompts, and differ from the scores after the student's prompt."""
    batch = PromptSource("addition_chat", 2, 2, tok, 400, 0, teacher_demonstrations=2).batch(0, 2)
    rollouts = rollouts_of(batch)
    scorer = ScorerWorker(str(chat_teacher_dir), "float32", 4, ProcessSettings("cpu"))
    with_context = scorer.score(rollouts, 8)
    direct = scorer.score(rollouts.teacher_view(), 8)
    plain = rollouts.rows(0, len(rollouts))
    plain.teacher_prompts = plain.teacher_prompt_mask = None
    without = scorer.score(plain, 8)
    assert torch.equal(with_context.teacher_log_probs, direct.teacher_log_probs)
    assert torch.equal(with_context.teacher_topk_ids, direct.teacher_topk_ids)
    mask = rollouts.response_mask.bool()
    assert not torch.allclose(with_context.teacher_log_probs[mask], without.teacher_log_probs[mask])
