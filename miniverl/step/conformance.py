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

The gate also scores a few of its rollouts twice with the teacher (teacher_self_test): the same rows must come back
the same, far below the distillation signal, or the teacher is noise (dropout on, a teacher left in train mode,
nondeterministic kernels, an fp16 overflow) and the run stops before training on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miniverl.batches import PromptBatch, RolloutBatch, TeacherScores
from miniverl.cluster.actors import call, call_all
from miniverl.errors import ConfigError
from miniverl.objectives.ratios import SamplerTolerance
from miniverl.rollout.sampling import SamplingParams
from miniverl.seeds import sampling_seed

if TYPE_CHECKING:
    from miniverl.objectives.interface import Objective

GATE_PROMPTS = 16  # prompt groups sampled for the gate (x rollout.n samples): a few hundred tokens
P99 = 0.99
SELF_TEST_ROWS = 4  # rollout rows (whole prompt groups, at least one) the teacher scores twice
SELF_TEST_TOPK = 16  # the support the self-test asks for when the run's is the full vocabulary (cheaper, same forward)
# How far two scorings of the same rows may sit apart: mean |delta log p| in nats over the sampled tokens (and the
# support's entries). The same kernels on the same rows repeat bit for bit on the CPU and on CUDA (cuBLAS and SDPA
# forwards are run-to-run deterministic): 0.0 measured on the built-in CPU teacher
# (tests/step/test_teacher_self_test.py).
# The bound is a tenth of what two *implementations* of one bf16 policy differ by at the gate (hf_cached vs the
# learner on H100, mean 9.96e-3 nats: docs/benchmarks/staleness-gpu/cell-gkd-bf16-hf_cached.log), and a
# five-hundredth of that run's per-token reverse KL to its teacher (0.49 nats, the same cell's metrics).
TEACHER_REPEAT_BOUND = 1e-3


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
    repeat = teacher_self_test(controller, batch, log)
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
        "teacher_repeat": repeat,
    }


def teacher_self_test(controller, batch: RolloutBatch, log=print) -> dict:
    """Score SELF_TEST_ROWS rows of `batch` twice with the run's teacher(s) (the run's support, top-SELF_TEST_TOPK
    where that is the full vocabulary) and refuse scores that do not repeat (check_teacher_repeat). Returns the
    numbers summary.json keeps (teacher_repeat_gap)."""
    starts = [i for i, u in enumerate(batch.uid) if i == 0 or u != batch.uid[i - 1]] + [len(batch.uid)]
    end = next(s for s in starts[1:] if s >= SELF_TEST_ROWS or s == len(batch.uid))  # whole groups only
    rows = batch.rows(0, end)
    k = controller.teacher_support_k
    k = SELF_TEST_TOPK if k == 0 else k
    first, second = (controller.fetch_scores(controller.score(rows, k)) for _ in range(2))
    gap = teacher_repeat_gap(first, second, rows.response_mask)
    check_teacher_repeat(gap)
    log(
        f"[miniverl] teacher self-test: {end} rows scored twice, |delta log p| mean {gap['sampled_mean']:.2e}"
        f" (max {gap['sampled_max']:.2e}) nats over {gap['tokens']} sampled tokens, support mean"
        f" {gap['support_mean']:.2e}: repeats"
    )
    return gap


def teacher_repeat_gap(first: TeacherScores, second: TeacherScores, mask: torch.Tensor) -> dict:
    """How far two scorings of the same rows sit apart, in nats over the masked tokens: sampled-token log-probs
    (mean, max) and the support's entries (mean; 0 without one), and whether every sampled log-prob is finite.
    Shapes: first, second: TeacherScores of [B, Tr] (support [B, Tr, K]); mask [B, Tr]."""
    keep = mask.bool()
    a, b = first.teacher_log_probs[keep], second.teacher_log_probs[keep]  # [tokens]
    finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
    diff = (a - b).abs()
    support = 0.0
    if first.teacher_topk_logprobs is not None and second.teacher_topk_logprobs is not None:
        # top-K values come sorted, so ids that swap places on a tie compare equal; the ids are not compared
        s = (first.teacher_topk_logprobs[keep] - second.teacher_topk_logprobs[keep]).abs()  # [tokens, K]
        support = float(s.nan_to_num(nan=float("inf")).mean()) if s.numel() else 0.0
    return {
        "sampled_mean": float(diff.nan_to_num(nan=float("inf")).mean()) if diff.numel() else 0.0,
        "sampled_max": float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0,
        "support_mean": support,
        "tokens": int(diff.numel()),
        "finite": finite,
        "bound": TEACHER_REPEAT_BOUND,
    }


def check_teacher_repeat(gap: dict) -> None:
    """ConfigError when two scorings of the same rows (teacher_repeat_gap) are not finite or differ beyond
    TEACHER_REPEAT_BOUND."""
    fix = (
        " Fix: score in eval mode (model.eval(): no dropout), with deterministic kernels"
        " (torch.use_deterministic_algorithms(True) to find the one), in a dtype that holds the logits"
        " (model.teacher.dtype=bfloat16 or float32, not float16)"
    )
    if not gap["finite"]:
        raise ConfigError(
            "the teacher's log-probs of the gate's sampled tokens are not finite (inf or NaN: an fp16 overflow,"
            f" or weights that were never loaded); check the teacher's checkpoint.{fix}"
        )
    worst = max(gap["sampled_mean"], gap["support_mean"])
    if worst > TEACHER_REPEAT_BOUND:
        raise ConfigError(
            f"the teacher scored the same {gap['tokens']} sampled tokens twice and disagreed with itself by mean"
            f" {gap['sampled_mean']:.3g} nats (max {gap['sampled_max']:.3g}; support mean {gap['support_mean']:.3g}),"
            f" above the {TEACHER_REPEAT_BOUND:g} a teacher repeats within: its scores are noise the student would"
            f" learn.{fix}"
        )
