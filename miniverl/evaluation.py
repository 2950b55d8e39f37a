"""Evaluation on the fixed held-out prompts: greedy accuracy and the temperature-1 reverse KL."""

from __future__ import annotations

from miniverl.config import MiniVerlConfig
from miniverl.controller import StrictSyncController, rollout_metrics
from miniverl.protocol import PromptBatch
from miniverl.rollout.sampling import SamplingParams


def evaluate(
    controller: StrictSyncController, batch: PromptBatch, cfg: MiniVerlConfig, stop_ids, reward_fn
) -> dict[str, float]:
    """Greedy accuracy and the temperature-1 reverse-KL estimate on the fixed eval prompts."""
    identity = controller.refresh()
    max_new = cfg.rollout.max_new_tokens
    greedy = controller.sample(batch, SamplingParams(1, max_new, 0.0, stop_token_ids=stop_ids), identity)
    sampled = controller.sample(
        batch, SamplingParams(1, max_new, 1.0, stop_token_ids=stop_ids, seed=cfg.rollout.seed + 17), identity
    )
    scores = controller.score(sampled, None)
    m = rollout_metrics(sampled, scores, reward_fn(sampled))
    return {
        "eval/accuracy": float(reward_fn(greedy).mean()),
        "eval/sampled_accuracy": m["accuracy"],
        "eval/reverse_kl": m["reverse_kl"],
    }


def eval_line(step: int, m: dict[str, float]) -> str:
    return (
        f"[miniverl] eval @ step {step}: greedy accuracy {m['eval/accuracy']:.3f},"
        f" reverse KL {m['eval/reverse_kl']:.4f} nats/token"
    )
