"""The planned work of one step and one evaluation, and its time on this device, said before Ray starts; a step or an
evaluation that would take longer than the device's bound is refused, naming the key to lower.

The throughput model is a rate per phase in response tokens a second (generated tokens; scoring and the update are
counted by the same tokens, at the prompt lengths the rates were measured with), one set per device kind:
- a step generates rows x max_new_tokens tokens (rows = data.prompts_per_step x rollout.n), scores them and trains on
  them: generate + score + update;
- an evaluation generates data.eval_prompts rows twice (greedy, then temperature 1: step/evaluation.py) and scores the
  sampled ones: 2 x generate + score.
Response tokens are counted at rollout.max_new_tokens (a row that stops early costs less), so the estimate is what the
step costs when nothing stops early. The rates are those of the models they were measured with; a larger model is
slower, so for it the estimate is a floor (a refusal is never one a faster model could have passed).
"""

from __future__ import annotations

from dataclasses import dataclass

from miniverl.errors import ConfigError


@dataclass(frozen=True)
class PhaseRates:
    """Response tokens a second of each phase of a step on one device kind."""

    generate: float
    score: float
    update: float
    models: str  # which models the rates were measured with (said in the plan line)


# The 2-core development machine, idle, one torch thread (each actor's share: resources.torch_threads=0), the built-in
# reverse models, 4,096-row batches of 12-token prompts and 16 new tokens: hf_cached generate 20.4k tok/s (17.7k at
# 16,384 rows), the teacher's forward 13.6k, the student's forward and backward 17.9k (lab/results/plan-rates-cpu.md,
# 2026-12-07). At the default's 64 rows they give 0.19 s a step against the 0.16 s measured
# (lab/results/default-run-cpu.md, d6bba3d, idle).
CPU_RATES = PhaseRates(generate=18_000.0, score=13_600.0, update=17_900.0, models="the built-in models")
# One H100, hf_cached, +experiment=gkd_4080 (Qwen2.5-0.5B student, 1.5B teacher shapes, 64 x 4 x 512 = 131,072 tokens a
# step): generate 1.13 s, score 1.45 s, update 1.72 s (lab/results/sglang-gpu/run5.md, 2026-12-07, 1a226bf).
CUDA_RATES = PhaseRates(generate=116_000.0, score=90_400.0, update=76_200.0, models="a 0.5B student, 1.5B teacher")
RATES = {"cpu": CPU_RATES, "cuda": CUDA_RATES}

# The longest a step or an evaluation may be planned to take. On the CPU (the built-in models and small real ones) the
# default step is 0.16 s: one of 2 minutes makes the default 400 steps a 13-hour run. On a GPU the slowest recipe
# measured, gkd_4080_7b, takes 44 s a step (lab/results/fit-planner.md), and its estimate at these rates is 4 s.
MAX_SECONDS = {"cpu": 120.0, "cuda": 600.0}


@dataclass(frozen=True)
class PlannedWork:
    """The sizes a run plans (its config's values), what one step and one evaluation do with them (rows, generated
    tokens) and their estimated seconds on the device."""

    prompts_per_step: int  # data.prompts_per_step
    n: int  # rollout.n
    max_new_tokens: int  # rollout.max_new_tokens
    total_steps: int  # trainer.total_steps
    device: str  # "cpu" or "cuda": which RATES and MAX_SECONDS apply
    step_rows: int
    step_tokens: int
    step_seconds: float
    eval_rows: int  # data.eval_prompts
    eval_tokens: int  # both generations together
    eval_seconds: float
    evaluations: int  # in the whole run: before training, every trainer.eval_every steps, and at the end
    run_seconds: float


def evaluation_count(total_steps: int, eval_every: int) -> int:
    """Evaluations of a run of `total_steps` (step/cadence.py): one before training, one after every `eval_every`-th
    step (0: none between), and one after the last step when it is not one of those."""
    between = total_steps // eval_every if eval_every else 0
    return 1 + between + (0 if eval_every and total_steps % eval_every == 0 else 1)


def device_kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def plan_work(
    prompts_per_step: int,
    n: int,
    max_new_tokens: int,
    eval_prompts: int,
    total_steps: int,
    eval_every: int,
    device: str,
) -> PlannedWork:
    """The planned work of one step and one evaluation and its seconds on `device` (the module's throughput model):
    the config's data.prompts_per_step, rollout.n, rollout.max_new_tokens, data.eval_prompts, trainer.total_steps and
    trainer.eval_every."""
    kind = device_kind(device)
    rates = RATES[kind]
    step_rows = prompts_per_step * n
    step_tokens = step_rows * max_new_tokens
    step_seconds = step_tokens / rates.generate + step_tokens / rates.score + step_tokens / rates.update
    eval_tokens = 2 * eval_prompts * max_new_tokens
    eval_seconds = eval_tokens / rates.generate + eval_prompts * max_new_tokens / rates.score
    evaluations = evaluation_count(total_steps, eval_every)
    run_seconds = total_steps * step_seconds + evaluations * eval_seconds
    return PlannedWork(
        prompts_per_step,
        n,
        max_new_tokens,
        total_steps,
        kind,
        step_rows,
        step_tokens,
        step_seconds,
        eval_prompts,
        eval_tokens,
        eval_seconds,
        evaluations,
        run_seconds,
    )


def duration(seconds: float) -> str:
    """`0.2 s`, `42 s`, `3.5 min`, `2.1 h`."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def check_planned_work(work: PlannedWork, log=print) -> None:
    """Say `work` (plan_work) in one line, and refuse a step or an evaluation over its device's MAX_SECONDS, naming the
    key to lower and how far. Needs no model: it runs before any is built or loaded."""
    rates, bound = RATES[work.device], MAX_SECONDS[work.device]
    where = "this CPU" if work.device == "cpu" else "this GPU"
    log(
        f"[miniverl] plan: a step generates {work.step_tokens:,} tokens over {work.step_rows:,} rows,"
        f" ~{duration(work.step_seconds)} on {where}; an evaluation {work.eval_tokens:,} tokens over"
        f" {work.eval_rows:,} rows, ~{duration(work.eval_seconds)}; {work.total_steps:,} steps and {work.evaluations}"
        f" evaluations ~{duration(work.run_seconds)} (at the rates of {rates.models}; larger models are slower)"
    )
    if work.step_seconds > bound:
        fits = int(work.prompts_per_step * bound / work.step_seconds)
        raise ConfigError(
            f"data.prompts_per_step={work.prompts_per_step:,}: a step would generate, score and train"
            f" {work.step_tokens:,} tokens over {work.step_rows:,} rows (x rollout.n={work.n}, up to"
            f" rollout.max_new_tokens={work.max_new_tokens} each), ~{duration(work.step_seconds)} on {where} at the"
            f" rates of {rates.models}, over the {duration(bound)} a step may take here; lower data.prompts_per_step"
            f" (at most ~{max(fits, 1):,} fit), rollout.n or rollout.max_new_tokens"
        )
    if work.eval_seconds > bound:
        fits = int(work.eval_rows * bound / work.eval_seconds)
        raise ConfigError(
            f"data.eval_prompts={work.eval_rows:,}: an evaluation would generate {work.eval_tokens:,} tokens over"
            f" {work.eval_rows:,} rows (greedy and sampled, up to rollout.max_new_tokens={work.max_new_tokens} each),"
            f" ~{duration(work.eval_seconds)} on {where} at the rates of {rates.models}, over the {duration(bound)}"
            f" an evaluation may take here; lower data.eval_prompts (at most ~{max(fits, 1):,} fit)"
        )
