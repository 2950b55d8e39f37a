"""The cadence of steps: steps start..total_steps, evaluation and checkpoint cadence, the operator's views.

It starts at any step (a resumed run starts after its checkpoint): the prompts of a step and its
sampling seeds are pure functions of the step, so steps k+1.. are the same whether or not the run
stopped at k. With trainer.staleness=1 a checkpoint does not hold the rollout in flight: a resumed run
samples its first step from the checkpointed policy (docs/reliability.md). Setting up (checks, models,
resume) is in miniverl/setup/, starting Ray and the actors in miniverl/cluster/launch.py, the whole run in
miniverl/main.py (train).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miniverl.batches import PromptBatch
from miniverl.checkpoints.store import prune, step_dir
from miniverl.cluster.actors import call
from miniverl.cluster.colocate import processes
from miniverl.cluster.faults import RunInterrupted, StopRequests, actor_names, dead_actor_error
from miniverl.config import MiniVerlConfig
from miniverl.objectives.sampler_check import VersionTestWatch
from miniverl.observe.tracking import Tracker
from miniverl.process import device_used_gib
from miniverl.rollout.sampling import SamplingParams
from miniverl.seeds import sampling_seed
from miniverl.step.controller import StrictSyncController
from miniverl.step.evaluation import TEACHER_CONTEXT_ACCURACY, eval_line, evaluate, teacher_context_line


@dataclasses.dataclass
class LoopResult:
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    checkpoint: str | None
    version_test: dict[str, Any]  # VersionTestWatch.summary(): what the sampler's version test could see


class TrainingLoop:
    def __init__(
        self,
        cfg: MiniVerlConfig,
        setup,  # run.Setup: prompts, eval batch, tokenizer, stop ids
        controller: StrictSyncController,
        actors: dict[str, list[Any]],
        tracker: Tracker,
        run_dir: Path,
        checkpoint_meta: dict[str, Any],
        stop: StopRequests,
        gauges=None,  # dashboard.RunGauges, or None without Ray
        after_step: Callable[[int, dict[str, list[Any]]], None] | None = None,
        checkpoint: str | None = None,
    ) -> None:
        self.cfg, self.setup, self.controller, self.actors = cfg, setup, controller, actors
        self.tracker, self.run_dir, self.meta, self.stop = tracker, run_dir, checkpoint_meta, stop
        self.gauges, self.after_step = gauges, after_step
        self.checkpoint = checkpoint  # the newest checkpoint written (or resumed from)
        self.first_eval: dict[str, float] = {}  # the step-0 evaluation, stored in every checkpoint
        self.current = 0  # the step in progress (0: the evaluation before training)
        self.params = setup.sampling
        self.names = actor_names(actors)
        self.version_test = VersionTestWatch()

    def evaluate(self, step: int) -> dict[str, float]:
        s, r = self.setup, self.cfg.rollout
        result = evaluate(
            self.controller,
            s.eval_batch,
            r.max_new_tokens,
            s.stop_token_ids,
            sampling_seed(r.seed, "eval", 0),
            s.reward_fn,
            s.tokenizer,
            self.cfg.trainer.eval_samples,
            teacher_context=step == 0 and self.cfg.model.teacher_is_self,  # the policy is still the teacher
        )
        self.tracker.log_samples(step, result.samples)
        self.tracker.write(eval_line(step, result.metrics))
        if TEACHER_CONTEXT_ACCURACY in result.metrics:
            self.tracker.write(teacher_context_line(result.metrics, len(s.eval_batch)))
        return result.metrics

    def save(self, done: int) -> str:
        path = step_dir(self.run_dir, done)
        meta = {**self.meta, "step": done, "first_eval": self.first_eval}  # a resumed run reports its start
        self.checkpoint = call(self.actors["learner"][0], "save_checkpoint", str(path), meta)
        prune(self.run_dir, self.cfg.trainer.keep_checkpoints)
        return self.checkpoint

    def run(self, start: int, first_eval: dict[str, float] | None) -> LoopResult:
        """Steps start+1..total_steps; `first_eval` is the step-0 evaluation of a resumed run.

        A dead actor (Ray raises RayActorError from any call) becomes an ActorDiedError naming the actor,
        the step and the last checkpoint.
        """
        from ray.exceptions import RayActorError

        self.current = start
        try:
            return self._run(start, first_eval)
        except RayActorError as e:
            raise dead_actor_error(e, self.names, self.current, self.checkpoint) from e

    def _run(self, start: int, first_eval: dict[str, float] | None) -> LoopResult:
        t = self.cfg.trainer
        if first_eval is None:
            first_eval = self.evaluate(0)
            self.tracker.log(0, first_eval, advance=False)
        self.first_eval = last = first_eval
        for step in range(start, t.total_steps):
            done = self.current = step + 1
            # trainer.staleness=1: the next step's rollout starts during this step's update (controller.py)
            upcoming = self._step_inputs(step + 1) if t.staleness and done < t.total_steps else None
            metrics = self.controller.step(*self._step_inputs(step), upcoming)
            metrics["data/overlong_filtered"] = self.setup.prompts.overlong_count
            used = device_used_gib() if self.setup.device == "cuda" else None
            if used is not None:  # after every refresh: a flat curve shows no memory leak per policy version
                metrics["gpu/device_used_gib"] = used
            if done == t.total_steps or (t.eval_every and done % t.eval_every == 0):
                last = self.evaluate(done)
                metrics.update(last)
            self._observe(done, metrics)
            due = done == t.total_steps or bool(t.save_every and done % t.save_every == 0)
            saved = t.save_checkpoint and due
            if saved:
                self.save(done)
            if self.after_step is not None:
                self.after_step(done, self.actors)
            if self.stop.requested and done < t.total_steps:
                self._interrupt(done, saved)
        return LoopResult(first_eval, last, self.checkpoint, self.version_test.summary())

    def _step_inputs(self, step: int) -> tuple[PromptBatch, SamplingParams]:
        """The prompts and sampling settings of `step`: pure functions of the step (a resumed run sees the same)."""
        params = dataclasses.replace(self.params, seed=sampling_seed(self.cfg.rollout.seed, "train", step))
        return self.setup.prompts.batch(step, self.cfg.data.prompts_per_step), params

    def _observe(self, done: int, metrics: dict[str, float]) -> None:
        self.tracker.log(done, metrics)
        warning = self.version_test.observe(done, metrics)
        if warning is not None:
            self.tracker.write(warning)
        if self.gauges is not None:
            self.gauges.record(done, metrics)
            if self.setup.device == "cuda":
                self.gauges.record_memory({name: call(a, "memory") for name, a in processes(self.actors).items()})

    def _interrupt(self, done: int, saved: bool) -> None:
        import signal

        name = signal.Signals(self.stop.signum).name
        if not self.cfg.trainer.save_checkpoint:
            raise RunInterrupted(
                f"{name} after step {done} (trainer.save_checkpoint=false: no checkpoint)", self.stop.signum
            )
        if not saved:
            self.save(done)
        raise RunInterrupted(
            f"{name} after step {done}: checkpoint {self.checkpoint} holds it; continue with trainer.resume=auto",
            self.stop.signum,
        )
