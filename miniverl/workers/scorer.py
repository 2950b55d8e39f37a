"""ScorerWorker: the teacher. Returns its log-prob of every sampled token and, for GKD, its support."""

from __future__ import annotations

import torch

from miniverl.models.loading import load_causal_lm, torch_dtype
from miniverl.models.logprobs import LOGPROB_CHUNK_ROWS, response_hidden, response_logits, token_logprobs
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
        quantization: str = "none",
        chunk_tokens: int = 0,
    ) -> None:
        """`vocab_size`: the student's logit count when the teacher pads its vocabulary further
        (models.loading.shared_vocab_size); the teacher's logits past it are dropped before every softmax.
        `quantization` nf4: a 4-bit teacher (model.teacher.quantization). `chunk_tokens` > 0: the LM head
        runs on that many response positions at a time (trainer.logprob_chunk_tokens), so the teacher never
        holds a micro-batch's [b, Tr, V] logits."""
        self.device = setup_process(process)
        self.model = load_causal_lm(model_path, torch_dtype(dtype, self.device), self.device, quantization).eval()
        self.micro_batch_size = micro_batch_size
        self.vocab_size = vocab_size
        self.chunk_tokens = chunk_tokens

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
        if self.chunk_tokens == 0:
            logits = response_logits(self.model, batch)  # [b, Tr, V]
            return self._score_logits(logits, batch.responses, batch.response_mask, support_k, temperature)
        hidden, head = response_hidden(self.model, batch)  # [b, Tr, H]
        parts = []
        for s in range(0, hidden.shape[1], self.chunk_tokens):
            cols = slice(s, s + self.chunk_tokens)
            logits = head(hidden[:, cols])  # [b, c, V]
            parts.append(
                self._score_logits(
                    logits, batch.responses[:, cols], batch.response_mask[:, cols], support_k, temperature
                )
            )
        return concat_tokens(parts)

    def _score_logits(
        self, logits: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, support_k, temperature
    ) -> TeacherScores:
        """Scores of the positions `logits` cover. Shapes: logits [b, t, V], responses [b, t] -> [b, t, ...]."""
        logits = logits[..., : self.vocab_size]  # [b, t, V_student], model dtype
        mask = response_mask.to(logits.device)
        sampled = token_logprobs(logits, responses.to(logits.device)) * mask  # [b, t] fp32
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
            # int32 ids: half the bytes of the step's largest hand-over (the learner casts back to gather)
            parts.append((top_lp.cpu(), top_ids.to(torch.int32).cpu(), tail.cpu()))
        cols = [torch.cat(c, dim=0) for c in zip(*parts)]
        if full:
            out.teacher_topk_logprobs = cols[0]
        else:
            out.teacher_topk_logprobs, out.teacher_topk_ids, out.teacher_tail_logprob = cols
        return out

    def memory(self) -> dict[str, float]:
        return memory_report(self.device)


def concat_tokens(parts: list[TeacherScores]) -> TeacherScores:
    """Scores of consecutive position chunks of the same rows, joined along the token axis."""

    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values, dim=1)

    return TeacherScores(
        cat("teacher_log_probs"),
        cat("teacher_topk_logprobs"),
        cat("teacher_topk_ids"),
        cat("teacher_tail_logprob"),
        parts[0].loss_temperature,
    )
