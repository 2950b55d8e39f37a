"""TeachersScorerWorker: one scorer actor holding every teacher of a multi-teacher run (docs/multi_teacher.md).

Why one actor and not one per teacher: on one GPU each extra actor process brings its own CUDA context
(~0.5 GiB that no model uses) and its own fractional GPU share to size; teachers also never score at the
same time under strict sync (the controller waits for the scorer before the update), so separate processes
would buy no overlap. Each teacher is an ordinary ScorerWorker inside this one process; the rows of a batch
are split by their teacher, each teacher scores its rows in its own micro-batches, and the scores are put
back in row order, so the learner receives one TeacherScores exactly as from a single teacher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miniverl.batches import RolloutBatch, TeacherScores, concat_scores
from miniverl.process import ProcessSettings, memory_report, setup_process
from miniverl.routing import TeacherRouting
from miniverl.workers.scorer import ScorerWorker


@dataclass(frozen=True)
class TeacherLoad:
    """How to load one named teacher (model.teachers.<name>, resolved to a directory or hub id)."""

    path: str
    dtype: str
    quantization: str = "none"


class TeachersScorerWorker:
    def __init__(
        self,
        teachers: dict[str, TeacherLoad],
        routing: TeacherRouting,
        micro_batch_size: int,
        process: ProcessSettings,
        vocab_size: int | None = None,
        chunk_tokens: int = 0,
        max_tokens_per_micro_batch: int = 0,
        support_k: int | None = 0,
        loss_temperature: float = 1.0,
        max_row_tokens: int = 0,
    ) -> None:
        """Loads every teacher once, in this process (see the module docstring for why); on a GPU each teacher's
        forwards are then sized for the share left beside all of them."""
        self.device = setup_process(process)
        self.routing = routing
        self.scorers = {
            name: ScorerWorker(
                t.path,
                t.dtype,
                micro_batch_size,
                process,
                vocab_size=vocab_size,
                quantization=t.quantization,
                chunk_tokens=chunk_tokens,
                max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                support_k=support_k,
                loss_temperature=loss_temperature,
                max_row_tokens=max_row_tokens,
            )
            for name, t in teachers.items()
        }
        if self.device == "cuda":
            total = sum(s.weight_bytes() for s in self.scorers.values())
            for scorer in self.scorers.values():
                scorer.max_tokens = max_tokens_per_micro_batch
                scorer.max_tokens = scorer._size_micro_batches(process, total - scorer.weight_bytes())

    def score(self, batch: RolloutBatch, support_k: int | None, temperature: float = 1.0) -> TeacherScores:
        """ScorerWorker.score, each row by its data_source's teacher; rows come back in batch order."""
        parts, order = [], []
        for name, rows in self.routing.split(batch.data_source).items():
            # a teacher's rows are whole uid groups (every sample of a prompt shares its data_source)
            parts.append(self.scorers[name].score(batch.select(rows), support_k, temperature))
            order += rows
        scores = concat_scores(parts)
        if order == list(range(len(batch))):
            return scores
        return take_scores(scores, torch.tensor(order).argsort())

    def source_kl(self, batch: RolloutBatch, scores: TeacherScores) -> dict[str, tuple[float, float]]:
        """The k1 sums per data_source and per teacher of `batch` under `scores` (miniverl/routing.py
        source_kl_sums): the per-source metrics' share that needs the teacher's log-probs, computed here, where
        the scores were made, so the driver fetches a few numbers instead of the scores with their top-K support."""
        from miniverl.routing import source_kl_sums

        return source_kl_sums(
            batch.data_source, self.routing, batch.response_mask, batch.rollout_log_probs, scores.teacher_log_probs
        )

    def memory(self) -> dict[str, float]:
        return memory_report(self.device)


def take_scores(scores: TeacherScores, idx: torch.Tensor) -> TeacherScores:
    """Rows `idx` of `scores` (a permutation puts them back in batch order). Shapes: idx [B]."""

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[idx]

    return TeacherScores(
        scores.teacher_log_probs[idx],
        take(scores.teacher_topk_logprobs),
        take(scores.teacher_topk_ids),
        take(scores.teacher_tail_logprob),
        scores.loss_temperature,
    )
