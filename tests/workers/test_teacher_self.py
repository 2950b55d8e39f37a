"""model.teacher.path=self: the student's own frozen base is the teacher, scored by the learner with its adapter
disabled. Its scores equal a separate scorer's of the student's directory (after the teacher's own prompts), the
adapter is untouched by scoring, a run plans and places no scorer, and what cannot be the student's base is
refused before any model loads."""

from __future__ import annotations

import pytest
import torch

from miniverl.config import validate
from miniverl.data.prompts import PromptSource
from miniverl.errors import ConfigError
from miniverl.models.loading import load_tokenizer
from miniverl.models.lora import LoraSettings
from miniverl.objectives.gkd import GkdObjective
from miniverl.process import ProcessSettings
from miniverl.rollout.sampling import SamplingParams
from miniverl.setup.prepare import prepare
from miniverl.step.controller import StrictSyncController
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from tests.test_config import load

CPU = ProcessSettings("cpu", torch_threads=1)
LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0)
OBJECTIVE = GkdObjective(beta=0.0, loss_temperature=1.0, teacher_topk=8)


def chat_source(chat_student_dir, demonstrations: int = 2) -> PromptSource:
    tok = load_tokenizer(str(chat_student_dir))
    return PromptSource("addition_chat", 2, 2, tok, 400, 0, teacher_demonstrations=demonstrations)


def learner_of(model_dir) -> LearnerWorker:
    return LearnerWorker(str(model_dir), LORA, "float32", OBJECTIVE, 1e-2, 0.0, 1.0, 4, CPU)


def test_the_learner_scores_as_a_scorer_of_its_base_with_the_adapter_left_in_place(chat_student_dir):
    """After real updates (a non-zero adapter) the learner's teacher scores are the base's, as a ScorerWorker of the
    student's directory gives them, after the teacher prompts; its policy's log-probs are the same before and after."""
    source = chat_source(chat_student_dir)
    learner = learner_of(chat_student_dir)
    rollout = RolloutWorker("hf_cached", str(chat_student_dir), LORA, "float32", CPU)
    scorer = ScorerWorker(str(chat_student_dir), "float32", 4, CPU)
    params = SamplingParams(2, 6, 1.0, seed=0)
    for step in range(2):  # move the adapter away from its zero start
        rollout.load_policy(learner.publish_policy())
        batch = rollout.generate(source.batch(step, 2), params)
        learner.update(batch, scorer.score(batch, 8), None)
    rollout.load_policy(learner.publish_policy())
    batch = rollout.generate(source.batch(2, 2), params)
    policy_before = learner.sampled_logprobs(batch)
    own, separate = learner.score(batch, 8), scorer.score(batch, 8)
    mask = batch.response_mask.bool()
    assert torch.allclose(own.teacher_log_probs, separate.teacher_log_probs, atol=1e-5)
    assert torch.equal(own.teacher_topk_ids, separate.teacher_topk_ids)
    assert torch.allclose(own.teacher_tail_logprob, separate.teacher_tail_logprob, atol=1e-5)
    sampled_only = learner.score(batch, None)  # PG-k1's: the sampled tokens' log-probs alone
    assert sampled_only.teacher_topk_ids is None
    assert torch.allclose(sampled_only.teacher_log_probs, separate.teacher_log_probs, atol=1e-5)
    assert torch.equal(learner.sampled_logprobs(batch), policy_before)  # scoring left the adapter on
    # the positive control: the adapter moved, so the policy is no longer its base
    assert not torch.allclose(policy_before[mask], own.teacher_log_probs[mask], atol=1e-3)
    assert learner.model.training  # back in train mode for the next update


def test_two_steps_with_the_learner_as_its_own_teacher(chat_student_dir):
    """The controller takes the learner as its scorer (as build_actors hands it over): with demonstrations the
    context is a signal (small on a tiny random model, but not the zero of teacher = student), the steps train."""
    source = chat_source(chat_student_dir)
    learner = learner_of(chat_student_dir)
    rollout = RolloutWorker("hf_cached", str(chat_student_dir), LORA, "float32", CPU)
    ctl = StrictSyncController(rollout, learner, learner, lambda b: torch.zeros(len(b.uid)), 8, 1.0)
    start = [p.detach().clone() for p in learner.params]
    for step in range(2):
        metrics = ctl.step(source.batch(step, 2), SamplingParams(2, 6, 1.0, seed=step))
        assert metrics["loss"] > 0 and metrics["reverse_kl"] != 0.0
    assert learner.version == 2
    assert max(float((p.detach() - p0).abs().max()) for p, p0 in zip(learner.params, start)) > 1e-4


def test_a_run_with_teacher_self_places_and_plans_no_scorer(chat_student_dir):
    cfg = load(
        "data.task=addition_chat",
        "data.min_len=2",
        "data.max_len=2",
        "data.max_prompt_length=400",
        "data.teacher_demonstrations=2",
        f"model.student.path={chat_student_dir}",
        "model/teacher=self",
    )
    setup = prepare(cfg, log=lambda *_: None)
    assert setup.paths["teacher"] == setup.paths["student"]
    assert setup.placement.count["scorer"] == 0 and setup.placement.totals()["scorer"] == {"CPU": 0.0, "GPU": 0.0}


def test_the_plan_has_no_scorer_process(chat_student_dir):
    """On a card the plan gives the scorer no share, weights or CUDA context: the learner's share takes the rest."""
    from transformers import AutoConfig

    from miniverl.objectives import build_objective
    from miniverl.setup.fit import card_plan

    def plan(*overrides):
        cfg = load(
            f"model.student.path={chat_student_dir}",
            f"model.teacher.path={chat_student_dir}",
            "resources.emulate_gpu_gib=16",
            *overrides,
        )
        validate(cfg)
        config = AutoConfig.from_pretrained(str(chat_student_dir))
        paths = {"student": str(chat_student_dir), "teacher": str(chat_student_dir)}
        objective = build_objective(cfg.objective)
        return card_plan(cfg, objective, paths, {"student": config, "teacher": config}, config.vocab_size, True)

    separate, own = plan(), plan("model.teacher.path=self")
    scorer = {a.role: a for a in own.actors}["scorer"]
    assert own.layout["resources.scorer.num_gpus"] == 0.0  # chosen, and said: the learner scores
    assert scorer.weight_bytes == 0 and scorer.peak_bytes == 0 and scorer.problem is None
    assert own.contexts == separate.contexts - 1 and not own.refusals
    learner = {a.role: a for a in own.actors}["learner"]
    assert learner.fraction > {a.role: a for a in separate.actors}["learner"].fraction


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.student.path=self",), "model.student.path=self: only the teacher can be"),
        (("model.teacher.path=self", "model.teacher.dtype=float32"), "drop model.teacher.dtype and"),
        (("model.teacher.path=self", "model.teacher.quantization=nf4"), "drop model.teacher.dtype and"),
        (("model.teacher.path=self", "resources.scorer_gpus=1", "resources.gpus=1"), "no scorer actor starts"),
        (("model.teacher.path=self", "resources.scorer.num_gpus=0.3"), "no scorer actor starts"),
        (
            ("+model.teachers={rev:{path:self}}", "model.default_teacher=rev"),
            "model.teachers.rev.path=self: the student's own base is a teacher only as the single",
        ),
    ],
)
def test_what_cannot_be_the_students_base_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load(*overrides))


@pytest.mark.parametrize("colocate", [False, True])
def test_the_launcher_starts_no_scorer_and_hands_the_learners_over(student_dir, monkeypatch, colocate):
    """build_actors with model.teacher.path=self, separate and colocated (Ray's calls stubbed: what is checked is what
    the launcher starts): no ScorerWorker, and the controller's scorers are the learners' handles."""
    import ray

    from miniverl.cluster import launch
    from miniverl.cluster.colocate import RoleHandle, processes
    from miniverl.objectives.gkd import GkdObjective
    from miniverl.workers.scorer import ScorerWorker

    started: list = []

    def remote_actor(cls, num_cpus, num_gpus, placement, *args, **kwargs):
        started.append(sorted(args[0]) if colocate else cls)  # colocated: the roles' constructors by role
        return object()

    monkeypatch.setattr(launch, "remote_actor", remote_actor)
    monkeypatch.setattr(launch, "_wait_ready", lambda name, group: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    cfg = load(f"model.student.path={student_dir}", "model/teacher=self", f"resources.colocate={colocate}")
    actors, _ = launch.build_actors(cfg, prepare(cfg, log=lambda *_: None), GkdObjective(0.5, 1.0, 0))
    if colocate:
        assert started == [["learner", "rollout"]]
        (scorer,) = actors["scorer"]
        assert isinstance(scorer, RoleHandle) and scorer.role == "learner"
    else:
        assert ScorerWorker not in started and LearnerWorker in started and len(started) == 2
        assert actors["scorer"] is actors["learner"]
    assert sorted(processes(actors)) == (["colocated"] if colocate else ["learner", "rollout"])


def test_a_gpu_run_with_teacher_self_takes_a_zero_scorer_share_on_an_emulated_card():
    """gkd_4080 with model.teacher.path=self sets resources.scorer.num_gpus=0 on a 16 GiB emulated card: no scorer
    process, so no CUDA context to leave room for (the first GPU run of it was refused here, 2026-12-07)."""
    from miniverl.setup.preflight import check_device_settings

    cfg = load("model.teacher.path=self", "resources.scorer.num_gpus=0", "resources.emulate_gpu_gib=16")
    check_device_settings(cfg, "cuda")  # no refusal
    with pytest.raises(ConfigError, match="resources.scorer.num_gpus=0 of resources.emulate_gpu_gib=16"):
        check_device_settings(load("resources.scorer.num_gpus=0", "resources.emulate_gpu_gib=16"), "cuda")
