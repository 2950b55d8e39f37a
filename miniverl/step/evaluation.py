"""Evaluation on the held-out prompts: greedy accuracy (overall and per data_source), the temperature-1
reverse-KL estimate, response length, and a few sample rows for people to read; and the finished run's summary
(summary.json and the last lines it prints), its first and last evaluation at its head."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from miniverl.batches import PromptBatch, RolloutBatch
from miniverl.cluster.actors import call
from miniverl.cluster.colocate import processes
from miniverl.config import MiniVerlConfig
from miniverl.objectives.aggregation import masked_mean
from miniverl.rollout.sampling import SamplingParams
from miniverl.routing import teacher_name
from miniverl.setup.records import Setup
from miniverl.step.controller import StrictSyncController, rollout_metrics


@dataclass
class EvalResult:
    metrics: dict[str, float]
    samples: list[dict] = field(default_factory=list)  # prompt/response/reward rows (greedy)


def evaluate(
    controller: StrictSyncController,
    batch: PromptBatch,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    sample_seed: int,
    reward_fn,
    tokenizer,
    num_samples: int,
) -> EvalResult:
    """Greedy accuracy and response length, and the k1 reverse KL of temperature-1 samples, on `batch`.

    reverse KL must be estimated on samples of the student itself (temperature 1, no truncation) to be
    unbiased, so it uses a second, sampled generation; accuracy is that of greedy answers. `sample_seed`
    seeds that sample (miniverl/seeds.py: purpose eval).
    """
    identity = controller.ensure_served()
    greedy = controller.sample(batch, SamplingParams(1, max_new_tokens, 0.0, stop_token_ids=stop_ids), identity)
    sampled = controller.sample(
        batch,
        SamplingParams(1, max_new_tokens, 1.0, stop_token_ids=stop_ids, seed=sample_seed),
        identity,
    )
    teacher = controller.fetch_scores(controller.score(sampled, None)).teacher_log_probs
    m = rollout_metrics(sampled, reward_fn(sampled), teacher)
    rewards = reward_fn(greedy)  # [G]
    metrics = {
        "eval/accuracy": float((rewards > 0.5).float().mean()),
        **accuracy_by_source(rewards, greedy.data_source),
        "eval/response_length": float(greedy.response_mask.sum(1).float().mean()),
        "eval/finished_frac": float(greedy.finished.float().mean()),
        "eval/sampled_accuracy": m["accuracy"],
        "eval/reverse_kl": m["reverse_kl"],
        **reverse_kl_by_source(sampled, teacher),
        **({"eval/teacher_prompt_tokens": m["teacher_prompt_tokens"]} if "teacher_prompt_tokens" in m else {}),
    }
    return EvalResult(metrics, sample_rows(greedy, rewards, tokenizer, num_samples))


def accuracy_by_source(rewards: torch.Tensor, data_source: list[str]) -> dict[str, float]:
    """`eval/accuracy/<data_source>` for every source present. Shapes: rewards [B]."""
    out = {}
    for source in sorted(set(data_source)):
        rows = torch.tensor([s == source for s in data_source])
        out[f"eval/accuracy/{source}"] = float((rewards[rows] > 0.5).float().mean())
    return out


def reverse_kl_by_source(sampled: RolloutBatch, teacher_log_probs: torch.Tensor) -> dict[str, float]:
    """`eval/reverse_kl/<data_source>`: the k1 reverse KL of the temperature-1 samples of each source (tokens
    of its rows pooled, as eval/reverse_kl). Shapes: teacher_log_probs [B, Tr]."""
    k1 = sampled.rollout_log_probs - teacher_log_probs  # [B, Tr]
    mask = sampled.response_mask.float()
    out = {}
    for source in sorted(set(sampled.data_source)):
        rows = torch.tensor([s == source for s in sampled.data_source])
        out[f"eval/reverse_kl/{source}"] = float(masked_mean(k1[rows], mask[rows]))
    return out


def sample_rows(batch: RolloutBatch, rewards: torch.Tensor, tokenizer, count: int) -> list[dict]:
    """The first `count` rows as readable text (special tokens kept in the prompt: the template shows)."""
    rows = []
    for i in range(min(count, len(batch))):
        prompt = batch.prompts[i][batch.prompt_mask[i].bool()].tolist()
        response = batch.responses[i][batch.response_mask[i].bool()].tolist()
        rows.append(
            {
                "data_source": batch.data_source[i],
                "prompt": tokenizer.decode(prompt),
                "response": tokenizer.decode(response),
                "ground_truth": batch.ground_truth[i],
                "reward": float(rewards[i]),
                "finished": bool(batch.finished[i]),
            }
        )
    return rows


def summary_by_source(first: dict[str, float], last: dict[str, float]) -> dict[str, dict[str, float]]:
    """{source: start/end greedy accuracy and reverse KL} from two evaluations' per-source metrics."""
    sources = sorted(k.split("/", 2)[2] for k in last if k.startswith("eval/accuracy/"))
    return {
        s: {
            f"{when}_{name}": ev.get(f"eval/{name}/{s}", float("nan"))
            for when, ev in (("start", first), ("end", last))
            for name in ("accuracy", "reverse_kl")
        }
        for s in sources
    }


def run_summary(
    cfg: MiniVerlConfig,
    setup: Setup,
    result,
    actors: dict[str, list[Any]],
    resumed_from: str | None,
    gate: dict[str, Any],
    metrics_file: str,
    wall_seconds: float,
) -> dict[str, Any]:
    """A finished run: its first and last evaluation, where it went, peak memory per actor process and the plan it
    was started on (None on the CPU), the gate's numbers.

    `result` is the loop's LoopResult (first_eval, last_eval, checkpoint, version_test).
    """
    memory = {name: call(a, "memory") for name, a in processes(actors).items()}
    return {
        "status": "finished",
        "steps": cfg.trainer.total_steps,
        "resumed_from": resumed_from,
        "objective": cfg.objective.name,
        "rollout_backend": cfg.rollout.backend,
        "device": setup.device,
        "chosen": setup.chosen,  # what the plan chose where the config left it null (shares, learner layout)
        "start_reverse_kl": result.first_eval["eval/reverse_kl"],
        "end_reverse_kl": result.last_eval["eval/reverse_kl"],
        "start_accuracy": result.first_eval["eval/accuracy"],
        "end_accuracy": result.last_eval["eval/accuracy"],
        "by_source": summary_by_source(result.first_eval, result.last_eval),
        "teachers": {
            teacher_name(r): f"self ({setup.paths[r]})" if cfg.model.teacher_is_self else setup.paths[r]
            for r in cfg.model.teacher_roles()
        },
        "wall_seconds": wall_seconds,
        "checkpoint": result.checkpoint,
        "metrics_file": metrics_file,
        "overlong_prompts_filtered": setup.prompts.overlong_count,
        "memory": memory,
        "plan": setup.plan,  # what the run planned for the memory above (None on the CPU)
        "conformance": gate,
        "version_test": result.version_test,  # objectives/sampler_check.py VersionTestWatch: steps voted, armed
    }


def eval_line(step: int, m: dict[str, float]) -> str:
    return (
        f"[miniverl] eval @ step {step}: greedy accuracy {m['eval/accuracy']:.3f},"
        f" reverse KL {m['eval/reverse_kl']:.4f} nats/token, response length {m['eval/response_length']:.1f}"
    )
