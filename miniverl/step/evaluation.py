"""Evaluation on the held-out prompts: greedy accuracy (overall and per data_source), the temperature-1
reverse-KL estimate, response length, and a few sample rows for people to read; at step 0 with the student's base as
its teacher, the teacher's own accuracy with its context; and the finished run's summary (summary.json and the last
lines it prints), its first and last evaluation at its head."""

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

# The step-0 evaluation's greedy accuracy of the teacher itself on the held-out teacher prompts
TEACHER_CONTEXT_ACCURACY = "eval/teacher_context_accuracy"


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
    teacher_context: bool = False,
) -> EvalResult:
    """Greedy accuracy and response length, and the k1 reverse KL of temperature-1 samples, on `batch`.

    reverse KL must be estimated on samples of the student itself (temperature 1, no truncation) to be
    unbiased, so it uses a second, sampled generation; accuracy is that of greedy answers. `sample_seed`
    seeds that sample (miniverl/seeds.py: purpose eval). `teacher_context`: the served policy is the teacher
    (model.teacher.path=self, before any update), so the teacher's own accuracy with its context is measured too
    (teacher_context_accuracy).
    """
    identity = controller.ensure_served()
    greedy_params = SamplingParams(1, max_new_tokens, 0.0, stop_token_ids=stop_ids)
    greedy = controller.sample(batch, greedy_params, identity)
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
    if teacher_context:
        metrics |= teacher_context_accuracy(controller, batch, greedy_params, identity, reward_fn)
    return EvalResult(metrics, sample_rows(greedy, rewards, tokenizer, num_samples))


def teacher_context_accuracy(
    controller: StrictSyncController, batch: PromptBatch, greedy: SamplingParams, identity, reward_fn
) -> dict[str, float]:
    """{TEACHER_CONTEXT_ACCURACY: the greedy accuracy of `batch`'s teacher prompts}, decoded by the rollout side and
    scored by the run's reward as the student's own greedy answers are; {} where the rows carry no teacher prompts.

    Only where the served policy is the teacher: model.teacher.path=self (the student's base) at version 0. Its
    LoRA adapter starts with lora_B = 0 (peft's initialization, models/lora.py build_lora_model; model.lora.init_seed
    draws only lora_A), so every adapted projection adds exactly 0 and v0 computes as the base does. A later version
    has moved off the base: {} there. A separate teacher model is never decoded (a scorer only scores), so the caller
    asks for this with `self` alone. `identity`: the served policy, as ensure_served proved it.
    """
    if batch.teacher_prompt_ids is None or identity.version != 0:
        return {}
    as_prompts = PromptBatch(
        batch.teacher_prompt_ids, batch.uid, batch.ground_truth, batch.data_source, batch.extra_info
    )
    rewards = reward_fn(controller.sample(as_prompts, greedy, identity))  # [G]
    return {TEACHER_CONTEXT_ACCURACY: float((rewards > 0.5).float().mean())}


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
        # the with-context teacher's greedy accuracy at step 0 (model.teacher.path=self with teacher prompts), else None
        "teacher_context_accuracy": result.first_eval.get(TEACHER_CONTEXT_ACCURACY),
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


def teacher_context_line(m: dict[str, float], prompts: int) -> str:
    """What the context does at the start: the with-context teacher's greedy accuracy beside the student's."""
    return (
        f"[miniverl] the teacher with its context: accuracy {m[TEACHER_CONTEXT_ACCURACY]:.3f} on {prompts} held-out"
        f" prompts; the student starts at {m['eval/accuracy']:.3f}"
    )
