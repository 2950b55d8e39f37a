"""SFT on the teacher's samples (off-policy distillation): the real-model benchmark's baseline at the recipe's
generated tokens (lab/results/real-model/README.md, its addendum of 2026-12-07).

The setting is the recipe's own, composed as `python -m miniverl.main +experiment=smollm2_addition` composes it
(the cells' overrides: total steps, eval every 20, rollout.seed and model.lora.init_seed = the seed): the same
student and LoRA, the same prompts in the same order (data.seed), the same teacher (the base model shown
data.teacher_demonstrations solved turns, no adapter) and the same held-out problems. Each step the teacher samples
rollout.n responses (temperature 1, at most rollout.max_new_tokens, stopping on the run's stop ids, with the seeds an
OPD step's rollout uses) for each of the step's prompts: the generated tokens of one OPD step. The student, shown its
own prompt without the demonstrations, takes one AdamW step (trainer.lr, weight_decay, max_grad_norm) of token-mean
cross-entropy on them. Evaluation is the product's (miniverl/step/evaluation.py on the product's hf_cached sampler,
teacher scorer and reward): greedy accuracy, finished fraction, response length, reverse KL to the teacher.

Writes OUT/metrics.jsonl, summary.json and samples.jsonl in the product's form (lab/real_model/report.py reads
them beside the product's runs), and OUT/.hydra/config.yaml (the composed config: its objective section is the
recipe's, which this loss does not read).

    PYTHONPATH=. python3 lab/real_model/sft.py --seed 0 --steps 100 --out DIR [key=value ...]
    PYTHONPATH=. python3 lab/real_model/sft.py --seed 0 --steps 2 --eval-prompts 16 --out /tmp/sft   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

EXPERIMENT = "smollm2_addition"
EVAL_EVERY = 20  # lab/real_model/cells.sh's trainer.eval_every: every cell is evaluated at the same steps
TAG = "[sft]"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="sft.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True, help="rollout.seed and model.lora.init_seed, as in cells.sh")
    ap.add_argument("--steps", type=int, default=100, help="trainer.total_steps")
    ap.add_argument("--out", required=True, help="run directory (refused when it already holds a run)")
    ap.add_argument("--eval-every", type=int, default=EVAL_EVERY, help="trainer.eval_every (0: start and end only)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="data.eval_prompts (default: the recipe's 500)")
    ap.add_argument("overrides", nargs="*", help="more key=value overrides of the composed config")
    args = ap.parse_args(argv)
    problems = [
        (args.seed < 0, f"--seed {args.seed}: use a seed >= 0"),
        (args.steps < 1, f"--steps {args.steps}: need at least 1 step (e.g. --steps 100)"),
        (args.eval_every < 0, f"--eval-every {args.eval_every}: use 0 (start and end only) or a step count"),
        (args.eval_prompts is not None and args.eval_prompts < 1, f"--eval-prompts {args.eval_prompts}: need >= 1"),
        (any("=" not in o for o in args.overrides), f"overrides {args.overrides}: write each as key=value"),
    ]
    for bad, message in problems:
        if bad:
            ap.error(message)
    out = Path(args.out).expanduser()
    if (out / "metrics.jsonl").exists():
        ap.error(f"--out {out} already holds a run (metrics.jsonl); pass a fresh directory")
    return args


def compose_config(args: argparse.Namespace):
    """(MiniVerlConfig, the composed DictConfig) of the recipe under the cells' overrides, checked as a run checks
    it (miniverl/fit.py composes the same way)."""
    from hydra import compose, initialize_config_dir

    from miniverl.config import check_values, register_configs, to_config
    from miniverl.main import CONF, check_objective_overrides
    from miniverl.setup.argv import checked_command_line

    argv = [
        f"+experiment={EXPERIMENT}",
        f"trainer.total_steps={args.steps}",
        f"trainer.eval_every={args.eval_every}",
        f"rollout.seed={args.seed}",
        f"model.lora.init_seed={args.seed}",
        *([f"data.eval_prompts={args.eval_prompts}"] if args.eval_prompts is not None else []),
        *args.overrides,
    ]
    register_configs()
    argv = checked_command_line(argv, None)
    check_objective_overrides(argv)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        composed = compose(config_name="config", overrides=argv)
    cfg = to_config(composed)
    check_values(cfg)
    return cfg, composed


class LocalEvaluation:
    """What miniverl.step.evaluation.evaluate asks of a controller, in this process: the student served by the
    product's rollout backend (its adapter loaded from the learner before each evaluation) and the teacher's
    log-probs from the product's ScorerWorker (after the teacher prompts, as a run's scorer scores)."""

    def __init__(self, server, scorer) -> None:
        self.server, self.scorer, self.version = server, scorer, 0

    def serve(self, adapter: dict[str, torch.Tensor], version: int) -> None:
        self.server.load_adapter(adapter)
        self.version = version

    def ensure_served(self) -> int:
        return self.version

    def sample(self, prompts, params, identity):
        return sample_rows(self.server, prompts, prompts.prompt_ids, params, self.version)

    def score(self, rollouts, support_k):
        return self.scorer.score(rollouts, support_k)

    @staticmethod
    def fetch_scores(scores):
        return scores


def sample_rows(backend, prompts, context: list[list[int]], params, version: int):
    """params.n samples of each row after `context` (the student's prompts, or the teacher's), as a RolloutBatch of
    `prompts` (the student's prompts before the responses): the seeds a rollout worker derives (row_seeds)."""
    from miniverl.rollout.sampling import row_seeds
    from miniverl.workers.rollout import to_rollout_batch

    completions = backend.generate(context, params, row_seeds(params.seed, len(context) * params.n))
    return to_rollout_batch(prompts, completions, params.n, version)


def sft_loss(model, batch) -> torch.Tensor:
    """Token-mean cross-entropy of the batch's response tokens (every token up to and including the stop token)
    after its prompts. Shapes: -> [] float32."""
    from miniverl.models.logprobs import response_logits, token_logprobs

    logits = response_logits(model, batch)  # [B, Tr, V]
    device = logits.device
    logp = token_logprobs(logits, batch.responses.to(device))  # [B, Tr]
    mask = batch.response_mask.to(device).float()
    return -(logp * mask).sum() / mask.sum().clamp(min=1.0)


def main(argv: list[str] | None = None) -> dict:
    from miniverl.errors import MiniVerlError

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg, composed = compose_config(args)
        return train(cfg, composed, Path(args.out).expanduser(), args.seed)
    except MiniVerlError as e:
        print(f"sft.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:  # Hydra's composition errors: a wrong override or config group
        if type(e).__module__.split(".")[0] not in ("hydra", "omegaconf"):
            raise
        print(f"sft.py: error: {str(e).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None


def train(cfg, composed, out: Path, seed: int) -> dict:
    from omegaconf import OmegaConf

    from miniverl.data.build import build_prompt_source
    from miniverl.models.loading import load_tokenizer, torch_dtype
    from miniverl.models.lora import LoraSettings, adapter_state, build_lora_model
    from miniverl.models.stops import resolve_stop_ids
    from miniverl.process import ProcessSettings
    from miniverl.rewards import build_reward
    from miniverl.rollout import BACKENDS
    from miniverl.rollout.sampling import SamplingParams
    from miniverl.seeds import sampling_seed
    from miniverl.setup.prepare import resolve_model_paths
    from miniverl.step.controller import rollout_metrics
    from miniverl.step.evaluation import eval_line, evaluate
    from miniverl.workers.scorer import ScorerWorker

    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t, r, d = cfg.trainer, cfg.rollout, cfg.data
    out.mkdir(parents=True, exist_ok=True)
    (out / ".hydra").mkdir(exist_ok=True)
    (out / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(composed))
    paths = resolve_model_paths(cfg.model, d, log=lambda line: print(line, flush=True))
    path = paths["student"]
    if paths["teacher"] != path:  # the recipe's teacher is the student's own base shown demonstrations
        raise SystemExit(f"sft.py: error: the teacher ({paths['teacher']}) is not the student's base ({path})")
    tok = load_tokenizer(path)
    source = build_prompt_source(d, tok, t.total_steps, log=lambda line: print(line, flush=True))
    eval_batch = source.eval_batch(d.eval_prompts)
    reward_fn = build_reward(cfg.reward, tok)
    lora = LoraSettings.from_config(cfg.model.lora)
    dtype = torch_dtype(cfg.model.student.dtype, device)
    learner = build_lora_model(path, lora, dtype, device)
    params = [p for p in learner.parameters() if p.requires_grad]
    stops = resolve_stop_ids(tok, path, r.stop_token_ids, learner.config.vocab_size)
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    backend = BACKENDS.get(r.backend)
    # The teacher samples through the rollout backend with every adapter tensor zero: exactly the base's forward.
    teacher = backend(model_path=path, lora=lora, dtype=dtype, device=device)
    teacher.load_adapter({k: torch.zeros_like(v) for k, v in teacher.adapter_weights().items()})
    server = backend(model_path=path, lora=lora, dtype=dtype, device=device)
    scorer = ScorerWorker(
        paths["teacher"],
        cfg.model.teacher.dtype,
        t.micro_batch_size,
        ProcessSettings(device=device),
        support_k=None,
        max_row_tokens=cfg.longest_row,
    )
    evaluation = LocalEvaluation(server, scorer)
    sampling = SamplingParams.from_config(r, stops)
    print(
        f"{TAG} {EXPERIMENT} seed {seed} on {device}: {t.total_steps} steps x {d.prompts_per_step} prompts x {r.n}"
        f" teacher samples (<= {r.max_new_tokens} tokens, temperature {r.temperature}), lr {t.lr}, LoRA r{lora.rank};"
        f" {len(eval_batch)} held-out problems; models loaded in {time.perf_counter() - start:.0f}s",
        flush=True,
    )
    metrics_file, samples_file = out / "metrics.jsonl", out / "samples.jsonl"

    def log(row: dict) -> None:
        with metrics_file.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def run_eval(step: int) -> dict:
        began = time.perf_counter()
        evaluation.serve(adapter_state(learner), step)
        result = evaluate(
            evaluation,
            eval_batch,
            r.max_new_tokens,
            stops,
            sampling_seed(r.seed, "eval", 0),
            reward_fn,
            tok,
            t.eval_samples,
        )
        with samples_file.open("a") as f:
            for row in result.samples:
                f.write(json.dumps({"step": step, **row}) + "\n")
        print(
            f"{TAG} {eval_line(step, result.metrics).removeprefix('[miniverl] ')} ({time.perf_counter() - began:.0f}s)",
            flush=True,
        )
        return result.metrics

    summary = {"status": "failed", "steps": 0, "objective": "sft", "rollout_backend": r.backend, "device": device}
    first = last = {}
    tokens = 0
    try:
        first = last = run_eval(0)
        log({"step": 0, **first, "generated_tokens": 0, "wall_seconds": time.perf_counter() - start})
        for step in range(t.total_steps):
            done = step + 1
            began = time.perf_counter()
            prompts = source.batch(step, d.prompts_per_step)
            params_k = dataclasses.replace(sampling, seed=sampling_seed(r.seed, "train", step))
            batch = sample_rows(teacher, prompts, prompts.teacher_prompt_ids, params_k, 0)
            sampled = time.perf_counter()
            learner.train()
            loss = sft_loss(learner, batch)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"step {done}: non-finite loss {loss.item()}; nothing applied")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
            optimizer.step()
            learner.eval()
            if device == "cuda":
                torch.cuda.synchronize()
            updated = time.perf_counter()
            step_tokens = int(batch.response_mask.sum())
            tokens += step_tokens
            teacher_m = rollout_metrics(batch, reward_fn(batch))  # the teacher's own samples: what the student copies
            row = {
                "step": done,
                "loss": loss.item(),
                "grad_norm": float(grad_norm),
                "response_tokens": step_tokens,
                "generated_tokens": tokens,
                **teacher_m,
                "time/refresh": 0.0,
                "time/generate": sampled - began,
                "time/score": 0.0,  # the loss needs no teacher scores: the samples are the targets
                "time/update": updated - sampled,
                "time/step": updated - began,
            }
            print(
                f"{TAG} step {done}/{t.total_steps}: loss {row['loss']:.4f}, {step_tokens} teacher tokens"
                f" ({tokens:,} so far), teacher sample accuracy {teacher_m['accuracy']:.3f}, finished"
                f" {teacher_m['finished_frac']:.2f}, step {row['time/step']:.2f}s (generate"
                f" {row['time/generate']:.2f}, update {row['time/update']:.2f})",
                flush=True,
            )
            if done == t.total_steps or (t.eval_every and done % t.eval_every == 0):
                last = run_eval(done)
                row.update(last)
            row["wall_seconds"] = time.perf_counter() - start
            log(row)
            summary["steps"] = done
        summary["status"] = "finished"
    except Exception as e:
        summary["error"] = f"{e.__class__.__name__}: {e}"
        raise
    finally:
        summary.update(
            {
                "start_accuracy": first.get("eval/accuracy", math.nan),
                "end_accuracy": last.get("eval/accuracy", math.nan),
                "start_reverse_kl": first.get("eval/reverse_kl", math.nan),
                "end_reverse_kl": last.get("eval/reverse_kl", math.nan),
                "generated_tokens": tokens,
                "seed": seed,
                "model": path,
                "wall_seconds": time.perf_counter() - start,
                "metrics_file": str(metrics_file),
            }
        )
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"{TAG} done: {summary['steps']} steps in {summary['wall_seconds']:.0f}s, {tokens:,} teacher tokens; greedy"
        f" accuracy {summary['start_accuracy']:.3f} -> {summary['end_accuracy']:.3f}, reverse KL"
        f" {summary['start_reverse_kl']:.4f} -> {summary['end_reverse_kl']:.4f}",
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main()
