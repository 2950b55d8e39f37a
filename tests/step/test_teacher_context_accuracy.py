"""eval/teacher_context_accuracy: at step 0 with the student's base as its teacher (model.teacher.path=self), the
evaluation also decodes the held-out rows' teacher prompts greedily through the rollout side and scores them with the
run's reward. It equals a direct greedy decode of those prompts by the base model; it is absent without teacher
prompts, after the first update, and wherever the cadence does not ask (a later step, a teacher that is not self)."""

from __future__ import annotations

import dataclasses
import shutil
from types import SimpleNamespace

import pytest
import torch

from miniverl.data.prompts import PromptSource
from miniverl.models.loading import load_causal_lm, load_tokenizer
from miniverl.models.lora import LoraSettings, build_lora_model
from miniverl.objectives.gkd import GkdObjective
from miniverl.process import ProcessSettings
from miniverl.rollout.sampling import SamplingParams
from miniverl.step import cadence
from miniverl.step.cadence import TrainingLoop
from miniverl.step.controller import StrictSyncController
from miniverl.step.evaluation import TEACHER_CONTEXT_ACCURACY, EvalResult, evaluate, teacher_context_line
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from tests.test_config import load

CPU = ProcessSettings("cpu", torch_threads=1)
LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0)
MAX_NEW = 6
EVAL_PROMPTS = 6


@pytest.fixture(scope="module")
def sharp_chat_dir(chat_student_dir, tmp_path_factory):
    """The tiny chat student with its weights redrawn at std 0.3 (norms kept): at the fixture's own 0.02 init every
    prompt's greedy answer is one token repeated, so no decode could tell the teacher prompts from the student's."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("sharp") / "student"
    shutil.copytree(chat_student_dir, path)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(path))
    return path


class ParityReward:
    """1 where a row's response token ids sum to an even number: on a random tiny model some rows pass and some do
    not, so the accuracy says which tokens were decoded (the numeric reward scores every row 0 there). It keeps the
    batches it scored."""

    def __init__(self) -> None:
        self.seen = []

    def __call__(self, batch) -> torch.Tensor:
        self.seen.append(batch)
        return torch.tensor([float(sum(r) % 2 == 0) for r in responses(batch)])


def responses(batch) -> list[list[int]]:
    return [batch.responses[i][batch.response_mask[i].bool()].tolist() for i in range(len(batch.uid))]


def self_teacher_run(model_dir):
    tok = load_tokenizer(str(model_dir))
    source = PromptSource("addition_chat", 2, 2, tok, 400, 0, teacher_demonstrations=2)
    learner = LearnerWorker(
        str(model_dir), LORA, "float32", GkdObjective(0.0, 1.0, 8), 1e-2, 0.0, 1.0, 4, CPU
    )  # the learner is its own teacher's scorer, as build_actors hands it over for model.teacher.path=self
    rollout = RolloutWorker("hf_cached", str(model_dir), LORA, "float32", CPU)
    reward = ParityReward()
    ctl = StrictSyncController(rollout, learner, learner, reward, 8, 1.0)
    stops = (tok.convert_tokens_to_ids("<|im_end|>"),)
    return tok, source, ctl, reward, stops


@torch.no_grad()
def base_greedy(model_dir, prompts: list[list[int]], stops: tuple[int, ...]) -> list[list[int]]:
    """Each prompt alone (no padding) through the base model without any adapter, argmax until a stop id."""
    model = load_causal_lm(str(model_dir), torch.float32, "cpu")
    out = []
    for prompt in prompts:
        ids, response = list(prompt), []
        for _ in range(MAX_NEW):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            response.append(token)
            if token in stops:
                break
        out.append(response)
    return out


def test_the_adapter_starts_at_zero_so_v0_is_the_base(chat_student_dir):
    """What makes the step-0 policy the teacher: every lora_B is 0 (lora_A is drawn), whatever the init seed."""
    model = build_lora_model(str(chat_student_dir), dataclasses.replace(LORA, init_seed=7), torch.float32, "cpu")
    b = [p for name, p in model.named_parameters() if "lora_B" in name]
    a = [p for name, p in model.named_parameters() if "lora_A" in name]
    assert b and all(bool((p == 0).all()) for p in b)
    assert any(bool((p != 0).any()) for p in a)


def test_the_metric_is_the_base_models_own_greedy_accuracy_on_the_teacher_prompts(sharp_chat_dir):
    tok, source, ctl, reward, stops = self_teacher_run(sharp_chat_dir)
    batch = source.eval_batch(EVAL_PROMPTS)
    assert batch.teacher_prompt_ids is not None and batch.teacher_prompt_ids != batch.prompt_ids
    result = evaluate(ctl, batch, MAX_NEW, stops, 0, reward, tok, 1, teacher_context=True)
    teacher_batch = reward.seen[-1]  # the last batch the reward scored: the teacher prompts' greedy answers
    direct = base_greedy(sharp_chat_dir, batch.teacher_prompt_ids, stops)
    assert responses(teacher_batch) == direct
    expected = sum(sum(r) % 2 == 0 for r in direct) / len(direct)
    assert 0.0 < expected < 1.0  # the parity reward tells rows apart here
    assert result.metrics[TEACHER_CONTEXT_ACCURACY] == pytest.approx(expected)
    # the student's own prompts gave other answers: the context is what was measured
    assert responses(reward.seen[1]) != direct  # [0] sampled, [1] greedy, [2] teacher
    line = teacher_context_line(result.metrics, len(batch))
    assert f"accuracy {expected:.3f} on {EVAL_PROMPTS} held-out prompts" in line
    assert f"the student starts at {result.metrics['eval/accuracy']:.3f}" in line


def test_absent_without_teacher_prompts_unasked_or_after_an_update(chat_student_dir):
    tok, source, ctl, reward, stops = self_teacher_run(chat_student_dir)
    batch = source.eval_batch(EVAL_PROMPTS)
    plain = dataclasses.replace(batch, teacher_prompt_ids=None)
    assert TEACHER_CONTEXT_ACCURACY not in evaluate(ctl, plain, MAX_NEW, stops, 0, reward, tok, 0, True).metrics
    assert TEACHER_CONTEXT_ACCURACY not in evaluate(ctl, batch, MAX_NEW, stops, 0, reward, tok, 0).metrics
    ctl.step(source.batch(0, 2), SamplingParams(2, MAX_NEW, 1.0, stop_token_ids=stops, seed=0))
    assert TEACHER_CONTEXT_ACCURACY not in evaluate(ctl, batch, MAX_NEW, stops, 0, reward, tok, 0, True).metrics


def test_the_cadence_asks_at_step_0_with_teacher_self_only(monkeypatch):
    """TrainingLoop.evaluate asks for it at step 0 when model.teacher.path=self, never later nor for another teacher,
    and prints the one line when it came back."""
    asked, lines = [], []

    def fake_evaluate(*args, teacher_context=False):
        asked.append(teacher_context)
        m = {"eval/accuracy": 0.25, "eval/reverse_kl": 0.1, "eval/response_length": 3.0}
        return EvalResult(m | ({TEACHER_CONTEXT_ACCURACY: 0.5} if teacher_context else {}))

    monkeypatch.setattr(cadence, "evaluate", fake_evaluate)
    tracker = SimpleNamespace(log_samples=lambda *a: None, write=lines.append)
    setup = SimpleNamespace(
        eval_batch=[0] * 4, stop_token_ids=(1,), reward_fn=None, tokenizer=None, sampling=SamplingParams(1, 4, 1.0)
    )
    for teacher, step, expected in (("self", 0, True), ("self", 3, False), ("builtin:teacher", 0, False)):
        cfg = load(f"model.teacher.path={teacher}")
        loop = TrainingLoop(cfg, setup, None, {}, tracker, None, {}, None)
        lines.clear()
        metrics = loop.evaluate(step)
        assert asked[-1] is expected and (TEACHER_CONTEXT_ACCURACY in metrics) is expected
        assert any("the teacher with its context: accuracy 0.500 on 4" in line for line in lines) is expected


def test_the_final_summary_prints_it_where_it_was_measured(tmp_path, capsys):
    from miniverl.main import print_summary

    summary = {"steps": 1, "objective": "gkd", "device": "cpu", "wall_seconds": 1.0, "memory": {}}
    summary |= {"start_reverse_kl": 1.0, "end_reverse_kl": 0.5, "start_accuracy": 0.1, "end_accuracy": 0.2}
    print_summary(summary | {"teacher_context_accuracy": None}, tmp_path)
    assert "the teacher with its context" not in capsys.readouterr().out
    print_summary(summary | {"teacher_context_accuracy": 0.35}, tmp_path)
    assert "the teacher with its context:       0.350 (greedy, step 0)" in capsys.readouterr().out
