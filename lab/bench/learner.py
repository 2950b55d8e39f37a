"""The learner-throughput bench: trained tokens per second of one LearnerWorker.update on a synthetic batch.

A batch here is what the rollout and the scorer would hand the learner at RL sizes: G x N rows of random
prompts and full-length responses, sampler log-probs, and a teacher support (top-K + tail for GKD, the
sampled token's log-prob for PG-k1). Nothing is sampled or scored: the bench isolates the update, the part
of a step that took 80% of it at the 16 GB recipe (DESIGN.md, "Where a step's time goes").

Shapes: B rows, Tp prompt tokens, Tr response tokens, K teacher support.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from miniverl.batches import RolloutBatch, TeacherScores
from miniverl.models.packing import row_lengths


@dataclass(frozen=True)
class LearnerCell:
    """One measurement: an objective at a batch shape with the learner's memory and speed settings."""

    objective: str  # gkd | pg_k1
    rows: int  # B = prompts x samples
    prompt_tokens: int  # Tp (every prompt this long: the bench measures the update, not padding)
    response_tokens: int  # Tr
    topk: int  # GKD's teacher support K (0 = full vocabulary)
    settings: dict  # LearnerWorker keyword arguments (micro-batching, chunking, checkpointing, ...)


def synthetic_batch(rows: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int) -> RolloutBatch:
    """A full-length batch of random tokens in groups of 4 rows, as the rollout hands it over.

    Shapes: -> prompts [B, Tp], responses [B, Tr] (every response token sampled: no padding).
    """
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (rows, prompt_tokens), generator=g)
    responses = torch.randint(0, vocab, (rows, response_tokens), generator=g)
    # Random weights give near-uniform policies: log(1/V) with a little noise is what a sampler would report.
    logprobs = (-torch.log(torch.tensor(float(vocab))) - torch.rand(rows, response_tokens, generator=g)).float()
    return RolloutBatch(
        prompts=prompts,
        prompt_mask=torch.ones_like(prompts),
        responses=responses,
        response_mask=torch.ones_like(responses),
        rollout_log_probs=logprobs,
        uid=[f"p{i // 4}" for i in range(rows)],
        ground_truth=[""] * rows,
        policy_version=0,
    )


def vary_lengths(batch: RolloutBatch, prompt_min: int, response_median: int, seed: int) -> RolloutBatch:
    """`batch` with realistic row lengths: each prompt keeps its last `prompt_min`..Tp tokens (uniform), each response
    its first 1..Tr tokens, geometric with median `response_median` (0: all Tr), as rows that stop do; the rest is
    padding (0 under a 0 mask, left for prompts, right for responses).

    Shapes: the batch's own, [B, Tp] and [B, Tr]."""
    b, tp = batch.prompts.shape
    tr = batch.responses.shape[1]
    if not 1 <= prompt_min <= tp or response_median < 0:
        raise ValueError(f"need 1 <= prompt_min <= {tp} and response_median >= 0, got {prompt_min}, {response_median}")
    g = torch.Generator().manual_seed(seed + 2)
    prompt_lens = torch.randint(prompt_min, tp + 1, (b,), generator=g)
    if response_median:
        stop = 1 - 2 ** (-1 / response_median)  # per token, so half the rows end within `response_median` tokens
        u = torch.rand(b, generator=g).clamp(min=1e-12)
        response_lens = (1 + torch.floor(torch.log(u) / math.log(1 - stop))).long().clamp(max=tr)
    else:
        response_lens = torch.full((b,), tr)
    prompt_mask = (torch.arange(tp) >= tp - prompt_lens[:, None]).long()
    response_mask = (torch.arange(tr) < response_lens[:, None]).long()
    return dataclasses.replace(
        batch,
        prompts=batch.prompts * prompt_mask,
        prompt_mask=prompt_mask,
        responses=batch.responses * response_mask,
        response_mask=response_mask,
        rollout_log_probs=batch.rollout_log_probs * response_mask,
    )


def synthetic_scores(batch: RolloutBatch, vocab: int, topk: int | None, seed: int) -> TeacherScores:
    """Teacher scores of `batch`: sampled-token log-probs, and a normalized top-K + tail support when `topk`.

    Shapes: -> teacher_log_probs [B, Tr], support [B, Tr, K] (+ tail [B, Tr]).
    """
    g = torch.Generator().manual_seed(seed + 1)
    b, t = batch.responses.shape
    sampled = (batch.rollout_log_probs - torch.rand(b, t, generator=g)).float()
    if topk is None:
        return TeacherScores(teacher_log_probs=sampled)
    if topk == 0:
        full = torch.log_softmax(torch.randn(b, t, vocab, generator=g), dim=-1)
        return TeacherScores(teacher_log_probs=sampled, teacher_topk_logprobs=full)
    ids = torch.argsort(torch.rand(b, t, vocab, generator=g), dim=-1)[..., :topk] if vocab <= 4096 else None
    if ids is None:  # a 152k argsort per position is slow on a CPU; distinct ids from a random offset instead
        offset = torch.randint(0, vocab - topk, (b, t, 1), generator=g)
        ids = offset + torch.arange(topk).view(1, 1, topk)
    # Teacher keeps 90% of its mass on the K ids (a peaked teacher), 10% in the tail.
    top = torch.log_softmax(torch.randn(b, t, topk, generator=g), dim=-1) + torch.log(torch.tensor(0.9))
    tail = torch.full((b, t), float(torch.log(torch.tensor(0.1))))
    return TeacherScores(sampled, top.float(), ids, tail)


def objective_for(name: str, topk: int):
    """The objective the product builds for `name`, with the recipes' settings (GKD beta 0.5)."""
    if name == "gkd":
        from miniverl.objectives.gkd import GkdObjective

        return GkdObjective(beta=0.5, loss_temperature=1.0, teacher_topk=topk)
    if name == "pg_k1":
        from miniverl.objectives.pg_k1 import PgK1Objective

        return PgK1Objective(discount=0.0, is_cap=2.0, kl_coef=0.0, kl_kind="k1", reward_coef=0.0)
    raise ValueError(f"unknown objective {name!r}; known: gkd, pg_k1")


def exact_sampler(learner, batch: RolloutBatch) -> RolloutBatch:
    """`batch` with the log-probs an exact sampler of the learner's current policy would report: its own, computed
    untimed before each update. The learner refuses a step whose sampler sits too far from it (SamplerGapError): the
    bench's random stand-ins (log 1/V minus noise) sit 0.59 nats away, over every objective's bound; and, in batches
    the version test votes on, log-probs of the policy before the last update. Shapes: rollout_log_probs [B, Tr]."""
    learner.model.eval()
    logprobs = learner.policy_logprobs(batch)
    return dataclasses.replace(batch, rollout_log_probs=logprobs)


def ready_for_update(learner, batch: RolloutBatch) -> RolloutBatch:
    """The learner publishes (its version moves on, no weights are sent) and `batch` comes back as the sampler of
    that version would have produced it: its exact log-probs (exact_sampler) and its version stamp, so strict sync and
    the sampler checks take it as a step of a run."""
    learner.publish_policy(include_weights=False)
    return dataclasses.replace(exact_sampler(learner, batch), policy_version=learner.version)


def median_index(values: list[float]) -> int:
    """The index of the median of `values` (the upper one of an even count), so what belongs to that entry (its
    tokens) goes with it."""
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


def time_updates(
    learner,
    batch: RolloutBatch,
    scores: TeacherScores,
    warmup: int,
    repeats: int,
    draw: Callable[[int], tuple[RolloutBatch, TeacherScores]] | None = None,
) -> dict:
    """Seconds of each timed update after `warmup` untimed ones (their seconds too: a compiled learner,
    trainer.compile_layers, compiles in the first), and the learner's peak memory.

    Before each call, untimed, the batch gets the sampler log-probs of the learner's current policy and is
    stamped with its version: strict sync refuses stale data, and the version test (objectives/sampler_check.py)
    refuses log-probs of the policy before the last update once a batch has VERSION_TEST_MIN_ROWS rows (peers run 9
    lost its four learner cells to log-probs computed once, before the first update).

    `draw(i)`: the i-th update's (batch, scores) instead of `batch` every time: rows of new lengths each update, so
    each update's micro-batches are new shapes as a run's steps are (`batch` then only names the shapes). The rate
    is the median update's own (its tokens / its seconds).
    """
    cuda = torch.cuda.is_available() and learner.device == "cuda"
    times: list[float] = []
    warmups: list[float] = []
    tokens: list[int] = []
    for i in range(warmup + repeats):
        if draw is not None:
            batch, scores = draw(i)
        stamped = ready_for_update(learner, batch)
        if cuda:
            torch.cuda.synchronize()
            if i == warmup:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = learner.update(stamped, scores, None)
        if cuda:
            torch.cuda.synchronize()
        (times if i >= warmup else warmups).append(time.perf_counter() - start)
        if i >= warmup:
            tokens.append(int(batch.response_mask.sum()))
    middle = median_index(times)  # the median update
    return {
        "update_s": times,
        "warmup_update_s": warmups,
        "median_update_s": times[middle],
        "trained_tokens": tokens[-1],  # the last update's (every update's when `draw` is None)
        "trained_tokens_each": tokens,
        "tokens_per_s": tokens[middle] / times[middle],  # the median update's own rate
        "loss": metrics["loss"],
        "micro_batch_tokens": metrics["micro_batch_tokens"],  # lower than planned after an out-of-memory redo
        "row_tokens": sum(row_lengths(batch)),  # the real tokens the last update's forwards carried
        "update_split_s": {k: v for k, v in metrics.items() if k.startswith("time/update/")},  # the last update's
        **learner.memory(),
    }


def profile_update(learner, batch: RolloutBatch, scores: TeacherScores, path) -> None:
    """One more update under the torch profiler; its top kernels by device (or CPU) time go to `path`.

    Like the timed updates it hands the learner an exact sampler's log-probs: the bench's random stand-ins
    would be refused by the sampler-gap check (the first GPU profile attempt, 2026-12-01, was).
    """
    from pathlib import Path

    from miniverl.observe.profile import profiling, write_profile

    cuda = torch.cuda.is_available() and learner.device == "cuda"
    stamped = ready_for_update(learner, batch)
    with profiling(cuda) as prof:
        learner.update(stamped, scores, None)
    write_profile(prof, Path(path), cuda)
