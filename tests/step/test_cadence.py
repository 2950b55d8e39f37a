"""The step loop in-process (plain workers, no Ray): checkpoint cadence, pruning, and switching them off."""

from __future__ import annotations

from types import SimpleNamespace

from miniverl.checkpoints.store import list_checkpoints, step_dir
from miniverl.cluster.faults import StopRequests
from miniverl.observe.tracking import Tracker
from miniverl.rollout.sampling import SamplingParams
from miniverl.step.cadence import TrainingLoop
from miniverl.workers.rollout import RolloutWorker
from tests.step.test_controller import CPU, LORA, make_controller
from tests.test_config import load


def loop_setup(tok, prompts, reward_fn, cfg) -> SimpleNamespace:
    """What TrainingLoop reads of a run's Setup: the same prompts every step, on the CPU."""
    return SimpleNamespace(
        prompts=SimpleNamespace(batch=lambda step, g: prompts, overlong_count=0),
        eval_batch=prompts,
        tokenizer=tok,
        stop_token_ids=(tok.eos_token_id,),
        device="cpu",
        reward_fn=reward_fn,
        sampling=SamplingParams.from_config(cfg.rollout, (tok.eos_token_id,)),
    )


def run_loop(parts, student_dir, run_dir, *overrides: str, controller=None):
    tok, prompts, _, _ = parts
    if controller is None:
        controller = make_controller(RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU), parts)
    cfg = load("rollout.max_new_tokens=5", "trainer.eval_every=0", *overrides)
    setup = loop_setup(tok, prompts, controller.reward_fn, cfg)
    run_dir.mkdir(parents=True, exist_ok=True)  # train() makes it; the loop expects it
    tracker = Tracker(run_dir, {}, "disabled", "p", None, cfg.trainer.total_steps, False)
    loop = TrainingLoop(cfg, setup, controller, {"learner": controller.learners}, tracker, run_dir, {}, StopRequests())
    try:
        return loop.run(0, None)
    finally:
        tracker.finish({})


def test_checkpoints_follow_save_every_and_keep_the_newest(parts, student_dir, tmp_path):
    result = run_loop(parts, student_dir, tmp_path, "trainer.total_steps=3", "trainer.save_every=1")
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 2), step_dir(tmp_path, 3)]  # keep_checkpoints=2
    assert result.checkpoint == str(step_dir(tmp_path, 3))
    result = run_loop(parts, student_dir, tmp_path / "b", "trainer.total_steps=3", "trainer.save_every=2")
    assert list_checkpoints(tmp_path / "b") == [step_dir(tmp_path / "b", 2), step_dir(tmp_path / "b", 3)]


def test_save_checkpoint_false_writes_none(parts, student_dir, tmp_path):
    result = run_loop(parts, student_dir, tmp_path, "trainer.total_steps=2", "trainer.save_checkpoint=false")
    assert result.checkpoint is None and not (tmp_path / "checkpoints").exists()
    assert set(result.first_eval) >= {"eval/accuracy", "eval/reverse_kl"}


def test_a_run_refreshes_once_per_learner_version(parts, student_dir, tmp_path, monkeypatch):
    """Evaluation, the gate and the step share one owner of the served policy: 4 updates with evaluation
    every 2 steps publish v0..v4 once each (main published [0, 0, 1, 2, 2, 3, 4] without the gate)."""
    learner = parts[2]
    published = []
    publish = learner.publish_policy
    monkeypatch.setattr(learner, "publish_policy", lambda *a: published.append(learner.version) or publish(*a))
    controller = make_controller(RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU), parts)
    controller.ensure_served()  # what the conformance gate asks first
    overrides = ("trainer.total_steps=4", "trainer.eval_every=2", "trainer.save_checkpoint=false")
    run_loop(parts, student_dir, tmp_path, *overrides, controller=controller)
    assert published == [0, 1, 2, 3, 4] and controller.sync.refreshes == learner.version + 1 == 5
