"""Strict-sync distillation without Ray: the three workers as plain objects in one process.

    python examples/distill_in_process.py [steps]

Handy for debugging an objective or a backend with a debugger attached: the controller calls plain
objects exactly as it calls Ray actors. Uses the built-in models (built on first use).
"""

from __future__ import annotations

import dataclasses
import sys

from miniverl.config import MiniVerlConfig
from miniverl.models.lora import LoraSettings
from miniverl.objectives import build_objective
from miniverl.process import ProcessSettings
from miniverl.rollout.sampling import SamplingParams
from miniverl.setup.prepare import prepare
from miniverl.step.controller import StrictSyncController
from miniverl.step.evaluation import evaluate
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker


def main(steps: int) -> None:
    cfg = MiniVerlConfig()
    cfg.trainer.total_steps = steps
    setup = prepare(cfg)
    objective = build_objective(cfg.objective)
    lora = LoraSettings.from_config(cfg.model.lora)
    cpu = ProcessSettings("cpu")
    t = cfg.trainer
    rollout = RolloutWorker(cfg.rollout.backend, setup.paths["student"], lora, "auto", cpu)
    scorer = ScorerWorker(setup.paths["teacher"], "auto", t.micro_batch_size, cpu, vocab_size=setup.vocab_size)
    learner = LearnerWorker(
        setup.paths["student"], lora, "auto", objective, t.lr, t.weight_decay, t.max_grad_norm, t.micro_batch_size, cpu
    )
    reward = setup.reward_fn
    controller = StrictSyncController(
        rollout, scorer, learner, reward, objective.teacher_support_k, objective.loss_temperature
    )
    r = cfg.rollout
    params = SamplingParams(r.n, r.max_new_tokens, r.temperature, r.top_k, r.top_p, setup.stop_token_ids)

    def report() -> dict[str, float]:
        args = (r.max_new_tokens, setup.stop_token_ids, r.seed, reward, setup.tokenizer, 0)
        return evaluate(controller, setup.eval_batch, *args).metrics

    print("before:", report())
    for step in range(steps):
        m = controller.step(
            setup.prompts.batch(step, cfg.data.prompts_per_step), dataclasses.replace(params, seed=step)
        )
        if step % 20 == 0:
            print(f"step {step}: reverse KL {m['reverse_kl']:.3f}, accuracy {m['accuracy']:.3f}, loss {m['loss']:.4f}")
    print("after:", report())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
