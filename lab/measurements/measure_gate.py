"""The conformance gate's numbers for hf backends in fp32 and bf16 against an fp32 learner (built-in models).

    python lab/measurements/measure_gate.py

PG-k1 with truncation off (objective.is_cap=inf), so the gate decides on the numbers alone; the
sampling settings are the pg_k1 experiment's (n=4, 16 new tokens, temperature 1), on 16 eval prompts.
"""

from __future__ import annotations

import json
import math

import torch


def main() -> None:
    from miniverl.config import MiniVerlConfig
    from miniverl.errors import ConfigError
    from miniverl.models.lora import LoraSettings
    from miniverl.objectives.pg_k1 import PgK1Objective
    from miniverl.process import ProcessSettings
    from miniverl.rewards import ExactMatchReward
    from miniverl.rollout.sampling import SamplingParams
    from miniverl.setup.prepare import prepare
    from miniverl.step.conformance import conformance_gate
    from miniverl.step.controller import StrictSyncController
    from miniverl.workers.learner import LearnerWorker
    from miniverl.workers.rollout import RolloutWorker
    from miniverl.workers.scorer import ScorerWorker

    torch.set_num_threads(1)
    cfg = MiniVerlConfig()
    cfg.trainer.total_steps = 1
    setup = prepare(cfg, log=lambda *_: None)
    lora, cpu = LoraSettings.from_config(cfg.model.lora), ProcessSettings("cpu", torch_threads=1)
    student, teacher = setup.paths["student"], setup.paths["teacher"]
    params = SamplingParams(4, cfg.rollout.max_new_tokens, 1.0, stop_token_ids=setup.stop_token_ids)
    scorer = ScorerWorker(teacher, "float32", 16, cpu)
    for backend in ("hf_reference", "hf_cached"):
        for dtype in ("float32", "bfloat16"):
            objective = PgK1Objective(discount=0.0, is_cap=math.inf, kl_coef=0.0, kl_kind="k1", reward_coef=0.0)
            learner = LearnerWorker(student, lora, "float32", objective, 1e-3, 0.0, 1.0, 16, cpu)
            rollout = RolloutWorker(backend, student, lora, dtype, cpu)
            ctl = StrictSyncController(rollout, scorer, learner, ExactMatchReward(setup.tokenizer), None, 1.0)
            try:
                out = conformance_gate(ctl, setup.eval_batch, params, objective, ("pg_k1", backend), print)
            except ConfigError as e:
                out = {"decision": "refused", "message": str(e)}
            print(json.dumps({"backend": backend, "rollout_dtype": dtype, "learner_dtype": "float32", **out}))


if __name__ == "__main__":
    main()
