"""Issue 36, refs not copies: the driver fetches no tensor larger than the step's ids and masks.

The driver may hold the step's ids and masks (prompts, responses and their masks, [B, T]), per-token values of
their shape (the sampler's log-probs), rewards, per-row scalars and metric sums. The teacher's support ([B, Tr, K],
[B, Tr, V] for the full vocabulary) goes from scorer to learner by reference, or is reduced where it is made.

In-process every handle is a value and `fetch` (cluster/actors.py) passes it through; in a Ray run it is where the
driver calls ray.get. So a guard around `fetch`, wherever the driver's modules call it, sees exactly what a Ray run
brings into the driver.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from miniverl.batches import PromptBatch
from miniverl.cluster import actors
from miniverl.rewards import ExactMatchReward
from miniverl.routing import TeacherRouting
from miniverl.step.controller import StrictSyncController
from miniverl.step.evaluation import evaluate
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.teachers import TeacherLoad, TeachersScorerWorker
from tests.step.test_controller import CPU, LORA, PARAMS


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `value` through dataclasses, objects' attributes, dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, list | tuple | set):
        for v in value:
            yield from tensors_in(v)
    elif dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
        for v in vars(value).values():
            yield from tensors_in(v)


@pytest.fixture()
def fetched(monkeypatch) -> list[torch.Tensor]:
    """The tensors in everything the driver fetches: `fetch` wrapped in every miniverl module that imported it
    (the controller, the policy sync, and cluster/actors.py itself, whose `call` and `call_all` use it)."""
    real, seen = actors.fetch, []

    def guarded(handles: list[Any]) -> list[Any]:
        out = real(handles)
        seen.extend(tensors_in(out))
        return out

    modules = [m for n, m in sys.modules.items() if n.startswith("miniverl.") and getattr(m, "fetch", None) is real]
    assert actors in modules and len(modules) > 2  # the guard reaches the controller and the sync, not only actors
    for module in modules:
        monkeypatch.setattr(module, "fetch", guarded)
    return seen


def ids_elements(prompts: PromptBatch, n: int, max_new_tokens: int) -> int:
    """Elements of the step's token ids at their widest: rows (prompts x n) x (longest prompt + max_new_tokens),
    the size of its input_ids (prompts and responses side by side). Every id and mask tensor, and any [B, T]
    per-token value, is no larger; a teacher support [B, Tr, K] is larger once Tr x (K - 1) exceeds the prompt."""
    return len(prompts) * n * (max(map(len, prompts.prompt_ids)) + max_new_tokens)


def scorer_outputs(monkeypatch, scorer) -> list:
    """What `scorer` returns from `score`, recorded (to show the guard had something large to catch)."""
    made, score = [], scorer.score
    monkeypatch.setattr(scorer, "score", lambda *a: made.append(score(*a)) or made[-1])
    return made


def four_prompts(tok, sources: list[str] | None = None) -> PromptBatch:
    texts = ["abc>", "de>", "fgh>", "ij>"]
    return PromptBatch(
        [tok(t)["input_ids"] for t in texts], [f"p{i}" for i in range(4)], [t[-2::-1] for t in texts], sources
    )


def check(fetched: list[torch.Tensor], made: list, bound: int) -> None:
    assert fetched, "the guard saw nothing: the driver fetches the rollout batch, so it must see its tensors"
    assert max(t.numel() for scores in made for t in tensors_in(scores)) > bound  # the teacher's support would not pass
    too_large = [(tuple(t.shape), t.dtype) for t in fetched if t.numel() > bound]
    assert not too_large, f"the driver fetched tensors of more than {bound} elements: {too_large}"


def test_the_driver_fetches_nothing_larger_than_the_steps_ids(parts, student_dir, fetched, monkeypatch):
    """Two rollout replicas, two scorer replicas and one learner (shard counts that differ: the learner's rows are
    both scorers' parts), full-vocabulary support: two steps, then an evaluation."""
    tok, _, learner, scorer = parts
    prompts = four_prompts(tok)
    made = scorer_outputs(monkeypatch, scorer)
    replicas = [RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU) for _ in range(2)]
    ctl = StrictSyncController(replicas, [scorer, scorer], learner, ExactMatchReward(tok), 0, 1.0)
    for _ in range(2):
        metrics = ctl.step(prompts, PARAMS)
    assert learner.version == 2 and metrics["reverse_kl"] != 0
    check(fetched, made, ids_elements(prompts, PARAMS.n, PARAMS.max_new_tokens))
    fetched.clear()  # the evaluation (one greedy and one sampled row per prompt) fetches the sampled-token scores only
    result = evaluate(ctl, prompts, PARAMS.max_new_tokens, PARAMS.stop_token_ids, 0, ExactMatchReward(tok), tok, 1)
    assert "eval/reverse_kl" in result.metrics
    check(fetched, made, ids_elements(prompts, 1, PARAMS.max_new_tokens))


def test_several_teachers_send_the_driver_sums_not_scores(parts, student_dir, teacher_dir, fetched, monkeypatch):
    """Two teachers routed by data_source, two scorer replicas and one learner, top-4 support: the per-source
    reverse KL reaches the driver as the scorers' sums."""
    tok, _, learner, _ = parts
    prompts = four_prompts(tok, ["reverse", "sort", "reverse", "sort"])
    loads = {"rev": TeacherLoad(str(teacher_dir), "float32"), "srt": TeacherLoad(str(student_dir), "float32")}
    scorer = TeachersScorerWorker(loads, TeacherRouting({"reverse": "rev"}, "srt"), 4, CPU)
    made = scorer_outputs(monkeypatch, scorer)
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    routing = TeacherRouting({"reverse": "rev"}, "srt")
    ctl = StrictSyncController(rollout, [scorer, scorer], learner, ExactMatchReward(tok), 4, 1.0, routing=routing)
    metrics = ctl.step(prompts, PARAMS)
    assert metrics["by_teacher/rev/rows"] == metrics["by_teacher/srt/rows"] == 4
    check(fetched, made, ids_elements(prompts, PARAMS.n, PARAMS.max_new_tokens))
