"""Evaluate the final policies of a strict and a stale run (lab/bench_staleness_cpu.sh) again, on more
held-out prompts and several sampling seeds, in-process on the CPU.

    python lab/measurements/staleness_reeval.py RUN_ROOT [--step 400] [--prompts 512] [--sample-seeds 4]

RUN_ROOT holds staleness0/ and staleness1/ (the bench's temporary directory). Each run's config is composed
from its .hydra/overrides.yaml and its checkpoint step_<step> is loaded into a learner; the evaluation is
the run's own (miniverl/step/evaluation.py): greedy accuracy, and the k1 reverse KL of one temperature-1
sample per prompt.
The run's own evaluation (data.eval_prompts prompts, sample seed 0) is repeated first as a check that the
same policy is loaded (`own_eval_reverse_kl` must equal the run's logged value). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

CONF = Path(__file__).resolve().parents[2] / "conf"


def evaluate_run(run: Path, step: int, prompts: int, sample_seeds: int) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from miniverl.config import register_configs, to_config
    from miniverl.models.lora import LoraSettings
    from miniverl.objectives import build_objective
    from miniverl.process import ProcessSettings
    from miniverl.seeds import sampling_seed
    from miniverl.setup.prepare import prepare
    from miniverl.step.controller import StrictSyncController
    from miniverl.step.evaluation import evaluate
    from miniverl.workers.learner import LearnerWorker
    from miniverl.workers.rollout import RolloutWorker
    from miniverl.workers.scorer import ScorerWorker

    overrides = [o for o in OmegaConf.load(run / ".hydra" / "overrides.yaml") if not o.startswith("hydra.")]
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = to_config(compose(config_name="config", overrides=overrides))
    setup = prepare(cfg, log=lambda *a: None)
    cpu = ProcessSettings("cpu", 1)
    lora, t, m = LoraSettings.from_config(cfg.model.lora), cfg.trainer, cfg.model
    student = setup.paths["student"]
    rollout = RolloutWorker("hf_reference", student, lora, m.student.dtype, cpu)
    scorer = ScorerWorker(setup.paths["teacher"], m.teacher.dtype, t.micro_batch_size, cpu, vocab_size=setup.vocab_size)
    objective = build_objective(cfg.objective)
    learner = LearnerWorker(
        student, lora, m.student.dtype, objective, t.lr, t.weight_decay, t.max_grad_norm, t.micro_batch_size, cpu
    )
    learner.load_checkpoint(str(run / "checkpoints" / f"step_{step:08d}"))
    ctl = StrictSyncController(rollout, scorer, learner, setup.reward_fn, None, 1.0)

    def reverse_kl(batch, k: int) -> dict[str, float]:
        seed = sampling_seed(cfg.rollout.seed, "eval", k)
        stops = setup.stop_token_ids
        return evaluate(
            ctl, batch, cfg.rollout.max_new_tokens, stops, seed, setup.reward_fn, setup.tokenizer, 0
        ).metrics

    own = reverse_kl(setup.eval_batch, 0)["eval/reverse_kl"]
    batch = setup.prompts.eval_batch(prompts)
    results = [reverse_kl(batch, k) for k in range(sample_seeds)]
    kls = [r["eval/reverse_kl"] for r in results]
    return {
        "own_eval_reverse_kl": own,
        "reverse_kl_mean": statistics.fmean(kls),
        "reverse_kl_by_sample_seed": kls,
        "greedy_accuracy": results[0]["eval/accuracy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--step", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--sample-seeds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.root)
    runs = {s: evaluate_run(root / f"staleness{s}", args.step, args.prompts, args.sample_seeds) for s in (0, 1)}
    out = {
        "step": args.step,
        "prompts": args.prompts,
        "sample_seeds": args.sample_seeds,
        **{f"staleness={s}": r for s, r in runs.items()},
        "reverse_kl_stale_over_strict": runs[1]["reverse_kl_mean"] / runs[0]["reverse_kl_mean"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
