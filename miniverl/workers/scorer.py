"""ScorerWorker: the teacher. Returns its log-prob of every sampled token and, for GKD, its support."""

from __future__ import annotations

import torch

from miniverl.models.loading import load_causal_lm, torch_dtype
from miniverl.models.logprobs import LOGPROB_CHUNK_ROWS, response_logits, token_logprobs
from miniverl.protocol import RolloutBatch, TeacherScores, concat_scores
from miniverl.workers import ProcessSettings, memory_report, setup_process


class ScorerWorker:
    def __init__(
        self,
        model_path: str,
        dtype: str,
        micro_batch_size: int,
        process: ProcessSettings,
        vocab_size: int | None = None,
    ) -> None:
        """`vocab_size`: the student's logit count when the teacher pads its vocabulary further
        (models.loading.shared_vocab_size); the teacher's logits past it are dropped before every softmax."""
        self.device = setup_process(process)
        self.model = load_causal_lm(model_path, torch_dtype(dtype, self.device), self.device).eval()
        self.micro_batch_size = micro_batch_size
        self.vocab_size = vocab_size

    @torch.no_grad()
    def score(self, batch: RolloutBatch, support_k: int | None, temperature: float = 1.0) -> TeacherScores:
        """support_k None: sampled-token log-probs only; 0 (or >= V): full distribution; K: top-K + tail.

        The support is at `temperature` (the loss temperature); sampled-token log-probs at 1.
        """
        parts = [
            self._score_rows(batch.rows(s, s + self.micro_batch_size), support_k, temperature)
            for s in range(0, len(batch), self.micro_batch_size)
        ]

        return concat_scores(parts)

    def _score_rows(self, batch: RolloutBatch, support_k: int | None, temperature: float) -> TeacherScores:
        logits = response_logits(self.model, batch)[..., : self.vocab_size]  # [b, Tr, V_student], model dtype
        mask = batch.response_mask.to(logits.device)
        sampled = token_logprobs(logits, batch.responses.to(logits.device)) * mask  # [b, Tr] fp32
        out = TeacherScores(teacher_log_probs=sampled.cpu(), loss_temperature=temperature)
        if support_k is None:
            return out
        full = support_k == 0 or support_k >= logits.shape[-1]
        parts: list[tuple[torch.Tensor, ...]] = []
        for start in range(0, logits.shape[0], LOGPROB_CHUNK_ROWS):  # fp32 log-softmax a few rows at a time
            logp = torch.log_softmax(logits[start : start + LOGPROB_CHUNK_ROWS].float() / temperature, dim=-1)
            if full:
                parts.append((logp.cpu(),))
                continue
            top_lp, top_ids = logp.topk(support_k, dim=-1)  # [c, Tr, K]
            tail = torch.logsumexp(logp.scatter(-1, top_ids, float("-inf")), dim=-1)  # [c, Tr]
            parts.append((top_lp.cpu(), top_ids.cpu(), tail.cpu()))
        cols = [torch.cat(c, dim=0) for c in zip(*parts)]
        if full:
            out.teacher_topk_logprobs = cols[0]
        else:
            out.teacher_topk_logprobs, out.teacher_topk_ids, out.teacher_tail_logprob = cols
        return out

    def memory(self) -> dict[str, float]:
        return memory_report(self.device)
