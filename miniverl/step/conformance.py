"""The log-prob conformance gate: before training, does the rollout backend sample what the learner computes?

First the rollout side serves a non-zero trial adapter and must match the learner's probe under it (at
v0 lora_B is 0, where a wrong merge or a dropped adapter term is invisible). Then rollouts are sampled
through the backend with the run's sampling settings, the learner recomputes the
log-prob of every sampled token, and the gaps (mean and p99 |gap|, the fraction of importance ratios
outside [1/cap, cap]) are held against the tolerance the objective declares
(`objective.sampler_tolerance`, miniverl/objectives/). Within it: "pass". Outside it: "pass_with_tis"
when the objective truncates its importance ratios (PG-k1 with a finite objective.is_cap) and the gap is
one truncation can correct (objectives/ratios.py: TIS_MAX_*), else the run stops with the numbers and
the fix. The gate's honest gap then calibrates the bound every later step is held to before its optimizer step
(objectives/ratios.py, step_bound: a multiple of the gate's mean and p99, never looser than the objective's), so
a step sampled by anything but the learner's policy (a generation path that kept an older one) stops the run.
The learner's log-probs are those every update computes (its micro-batches, dropout off). The numbers go into
summary.json; every step logs its gap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miniverl.batches import PromptBatch
from miniverl.cluster.actors import call, call_all
from miniverl.errors import ConfigError
from miniverl.objectives.ratios import SamplerTolerance
from miniverl.rollout.sampling import SamplingParams
from miniverl.seeds import sampling_seed

if TYPE_CHECKING:
    from miniverl.objectives.interface import Objective

GATE_PROMPTS = 16  # prompt groups sampled for the gate (x rollout.n samples): a few hundred tokens
P99 = 0.99


@dataclass(frozen=True)
class GapStats:
    """Sampler vs learner log-probs over sampled tokens (nats), and ratios outside [1/cap, cap]."""

    mean_gap: float
    p99_gap: float
    outside_frac: float
    cap: float
    tokens: int
    std_gap: float = 0.0  # per-token std of |gap|: how far a step of few tokens may sit from the mean


def gap_stats(sampler: torch.Tensor, learner: torch.Tensor, mask: torch.Tensor, cap: float) -> GapStats:
    """Shapes: sampler, learner, mask [B, Tr] -> scalars over the masked tokens."""
    keep = mask.bool()
    diff = (learner.float() - sampler.float())[keep]  # [tokens]
    if diff.numel() == 0:
        raise ValueError("the gate's rollouts hold no sampled tokens; raise rollout.max_new_tokens")
    outside = (diff.abs() > torch.log(torch.tensor(cap))).float().mean()  # |log ratio| > log cap
    return GapStats(
        mean_gap=float(diff.abs().mean()),
        p99_gap=float(torch.quantile(diff.abs(), P99)),
        outside_frac=float(outside),
        cap=cap,
        tokens=int(diff.numel()),
        std_gap=float(diff.abs().std(correction=0)),
    )


def decide(stats: GapStats, tolerance: SamplerTolerance, objective: str, backend: str) -> str:
    """'pass' within the tolerance, 'pass_with_tis' outside it when ratios are truncated; else ConfigError."""
    within = (
        stats.mean_gap <= tolerance.mean_gap
        and stats.p99_gap <= tolerance.p99_gap
        and stats.outside_frac <= tolerance.outside_frac
    )
    if within:
        return "pass"
    correctable = stats.mean_gap <= tolerance.max_mean_gap and stats.outside_frac <= tolerance.max_outside_frac
    if tolerance.truncated and correctable:
        return "pass_with_tis"
    if tolerance.truncated:
        raise ConfigError(
            f"rollout backend {backend} fails objective {objective}'s log-prob conformance gate even with"
            f" truncated importance sampling: over {stats.tokens} sampled tokens its log-probs sit mean"
            f" {stats.mean_gap:.3g} nats from the learner's and {stats.outside_frac:.2%} of importance ratios lie"
            f" outside [1/{stats.cap:g}, {stats.cap:g}]; truncation corrects at most mean"
            f" {tolerance.max_mean_gap:g} and {tolerance.max_outside_frac:.2%} (beyond, the capped gradient is"
            " another objective). Fix: make the sampler compute what the learner computes (the same"
            " model.student.dtype and quantization on both sides, or rollout=hf_reference)"
        )
    fix = (
        "set objective.is_cap to a finite cap (e.g. 2, as verl) so truncated importance sampling corrects"
        " the gap, or make the sampler compute what the learner computes"
        if objective == "pg_k1"
        else "make the sampler compute what the learner computes"
    )
    raise ConfigError(
        f"rollout backend {backend} fails objective {objective}'s log-prob conformance gate: over"
        f" {stats.tokens} sampled tokens its log-probs sit mean {stats.mean_gap:.3g} / p99 {stats.p99_gap:.3g}"
        f" nats from the learner's, and {stats.outside_frac:.2%} of importance ratios lie outside"
        f" [1/{stats.cap:g}, {stats.cap:g}] (tolerated: mean {tolerance.mean_gap:g}, p99 {tolerance.p99_gap:g},"
        f" {tolerance.outside_frac:.2%}). Fix: {fix} (the same model.student.dtype and quantization on both"
        " sides, or rollout=hf_reference)"
    )


def conformance_gate(
    controller,
    prompts: PromptBatch,
    params: SamplingParams,
    objective: Objective,
    names: tuple[str, str],
    log=print,
    seed: int = sampling_seed(0, "gate", 0),
) -> dict:
    """Sample through the backend, recompute on the learner, decide; `names` = (objective, backend) as
    configured, `seed` the gate's sampling seed (miniverl/seeds.py). Returns the numbers summary.json keeps."""
    objective_name, backend = names
    prompts = prompts.select(list(range(min(GATE_PROMPTS, len(prompts)))))
    trial_gap = controller.sync.prove_trial_adapter()  # serving a non-zero adapter, before v0 (lora_B = 0)
    identity = controller.ensure_served()
    batch = controller.sample(prompts, dataclasses.replace(params, seed=seed), identity)
    tolerance = objective.sampler_tolerance
    learner = call(controller.learners[0], "sampled_logprobs", batch)  # [B, Tr], as every update computes them
    stats = gap_stats(batch.rollout_log_probs, learner, batch.response_mask, tolerance.cap)
    decision = decide(stats, tolerance, objective_name, backend)
    log(
        f"[miniverl] conformance gate: {backend} vs learner over {stats.tokens} sampled tokens, |gap| mean"
        f" {stats.mean_gap:.2e} p99 {stats.p99_gap:.2e} nats, {stats.outside_frac:.2%} of ratios outside"
        f" [1/{stats.cap:g}, {stats.cap:g}]: {decision}"
    )
    bound = call_all(
        controller.learners,
        "calibrate_sampler_gap",
        [(stats.mean_gap, stats.p99_gap, stats.std_gap)] * len(controller.learners),
    )
    log(
        f"[miniverl] every step's sampler gap is held to mean {bound[0]['mean']:.2e} nats (+ {bound[0]['spread']:.2e}"
        f" / sqrt(tokens)) and at most {bound[0]['tail_share']:.0%} of tokens beyond {bound[0]['tail']:.2e}"
        " (calibrated from the gate's)"
    )
    return {
        **dataclasses.asdict(stats),
        "decision": decision,
        "tolerance": dataclasses.asdict(tolerance),
        "step_bound": bound[0],
        "trial_adapter_probe_gap": trial_gap,
    }
