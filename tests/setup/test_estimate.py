"""The planned work of a step and an evaluation, said and bounded before Ray starts (setup/estimate.py), and the checks
that need no model made before any built-in model is built (issue 76)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from miniverl.errors import ConfigError
from miniverl.setup import estimate
from miniverl.setup.estimate import CPU_RATES, check_planned_work, evaluation_count, plan_work
from miniverl.setup.prepare import prepare_run
from tests.test_config import CONF, load

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def refuse_models(monkeypatch):
    """Make building, copying or loading any model fail the test: what is refused must be refused before."""

    def no_models(*args, **kwargs):
        raise AssertionError("a model was built or loaded before the refusal")

    monkeypatch.setattr("miniverl.setup.prepare.load_setup", no_models)
    monkeypatch.setattr("miniverl.setup.prepare.ensure_builtin_models", no_models)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.prompts_per_step=100000",
            r"data.prompts_per_step=100,000: a step would generate, score and train 3,200,000 tokens over 200,000 rows"
            r" .*~9.9 min on this CPU .* over the 2.0 min a step may take here; lower data.prompts_per_step",
        ),
        (
            "data.eval_prompts=100000",
            r"data.eval_prompts=100,000: an evaluation would generate 3,200,000 tokens over 100,000 rows .*~4.9 min on"
            r" this CPU .*; lower data.eval_prompts \(at most ~40,619 fit\)",
        ),
    ],
)
def test_sizes_no_cpu_can_run_are_refused_in_one_line_before_ray(tmp_path, monkeypatch, override, message):
    import ray

    refuse_models(monkeypatch)
    cfg = load(override, "resources.device=cpu")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=message) as refused:
        prepare_run(cfg, tmp_path / "run", dataclasses.asdict(cfg), log=lambda line: None)
    assert "\n" not in str(refused.value)
    assert not ray.is_initialized()
    assert time.perf_counter() - started < 5  # no prompt drawn, no model built
    assert not (tmp_path / "run").exists()


def test_a_builtin_teacher_known_not_to_learn_its_task_is_refused_before_its_build(tmp_path, monkeypatch):
    # Before: data.task=addition built the teacher for 2 minutes and then refused its 0.76 accuracy.
    import miniverl.setup.prepare as prepare

    monkeypatch.setattr(prepare, "ensure_builtin_models", refuse_models_call)
    cfg = load("data.task=addition", "data.min_len=1", "data.max_len=2", f"model.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ConfigError, match=r"reaches at most 0.76 greedy accuracy on addition .* before its build"):
        prepare_run(cfg, tmp_path / "run", dataclasses.asdict(cfg), log=lambda line: None)
    # a threshold the recipe can reach builds it as before: the check only refuses what would be refused after
    built = load("data.task=addition", "model.builtin_min_teacher_accuracy=0.5", f"model.cache_dir={tmp_path}")
    with pytest.raises(AssertionError, match="would build"):
        prepare_run(built, tmp_path / "run2", dataclasses.asdict(built), log=lambda line: None)


def refuse_models_call(*args, **kwargs):
    raise AssertionError("would build a built-in model")


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_shipped_experiment_is_refused_and_its_plan_is_said(experiment, device):
    lines = []
    d, r, t = (cfg := load(f"+experiment={experiment}")).data, cfg.rollout, cfg.trainer
    work = plan_work(d.prompts_per_step, r.n, r.max_new_tokens, d.eval_prompts, t.total_steps, t.eval_every, device)
    check_planned_work(work, lines.append)
    assert work.step_seconds < estimate.MAX_SECONDS[device] and work.eval_seconds < estimate.MAX_SECONDS[device]
    (line,) = lines
    where = "this CPU" if device == "cpu" else "this GPU"
    assert line.startswith("[miniverl] plan: a step generates ") and f"on {where}" in line


def test_the_default_experiment_says_its_plan_at_start(tmp_path, monkeypatch):
    refuse_models(monkeypatch)
    lines = []
    cfg = load("resources.device=cpu")
    with pytest.raises(AssertionError, match="before the refusal"):  # load_setup, after the plan: nothing refused
        prepare_run(cfg, tmp_path / "run", dataclasses.asdict(cfg), log=lines.append)
    assert (
        "[miniverl] plan: a step generates 1,024 tokens over 64 rows, ~0.2 s on this CPU; an evaluation 2,048 tokens"
        " over 64 rows, ~0.2 s; 400 steps and 5 evaluations ~77 s" in "\n".join(lines)
    )


def test_plan_arithmetic():
    work = plan_work(32, 2, 16, 64, 400, 100, "cpu")
    assert (work.step_rows, work.step_tokens, work.eval_rows, work.eval_tokens) == (64, 1024, 64, 2048)
    per_token = 1 / CPU_RATES.generate + 1 / CPU_RATES.score + 1 / CPU_RATES.update
    assert work.step_seconds == pytest.approx(1024 * per_token)
    assert work.eval_seconds == pytest.approx(2048 / CPU_RATES.generate + 1024 / CPU_RATES.score)
    assert work.run_seconds == pytest.approx(400 * work.step_seconds + 5 * work.eval_seconds)


@pytest.mark.parametrize(
    ("total", "every", "count"),
    [(400, 100, 5), (8, 0, 2), (10, 3, 5), (1, 100, 2), (100, 100, 2)],
)
def test_evaluation_count_follows_the_cadence(total, every, count):
    # before training; after every `every`-th step; after the last when it is not one of those (step/cadence.py)
    expected = 1 + len({k for k in range(1, total + 1) if k == total or (every and k % every == 0)})
    assert evaluation_count(total, every) == expected == count
