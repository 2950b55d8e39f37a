"""ScorerWorker: the teacher. Returns its log-prob of every sampled token and, for GKD, its support."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import record_function

from miniverl.batches import RolloutBatch, TeacherScores
from miniverl.models.fused_head import sampled_logprobs
from miniverl.models.loading import load_causal_lm, torch_dtype
from miniverl.models.packing import batch_micro_batches, pack_rows, packed_hidden
from miniverl.models.vocab_kernels import row_logsumexp
from miniverl.observe.profile import CallProfile, profiled
from miniverl.process import ProcessSettings, memory_report, memory_share_bytes, setup_process


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
        max_tokens_per_micro_batch: int = 0,
        support_k: int | None = 0,
        loss_temperature: float = 1.0,
        max_row_tokens: int = 0,
    ) -> None:
        """`vocab_size`: the student's logit count when the teacher pads its vocabulary further
        (models.loading.shared_vocab_size); the teacher's logits past it are dropped before every softmax.
        `quantization` nf4: a 4-bit teacher (model.teacher.quantization). `chunk_tokens` > 0: the LM head
        runs on that many response tokens at a time (trainer.logprob_chunk_tokens), so the teacher never
        holds a micro-batch's [N, V] logits. `max_tokens_per_micro_batch`: padded tokens per forward
        (0: `micro_batch_size` rows of the batch's longest). On a GPU the forwards are sized from the memory share
        for the support the run asks for (`support_k` and `loss_temperature`, as `score` takes them; the default
        counts the largest, a full support) and refused when a row of `max_row_tokens` does not fit."""
        self.device = setup_process(process)
        # MINIVERL_PROFILE_CALL (observe/profile.py); named by the teacher's directory: several share a process
        self.profile = CallProfile(f"scorer-{Path(model_path).name}", self.device)
        self.model = load_causal_lm(model_path, torch_dtype(dtype, self.device), self.device, quantization).eval()
        self.micro_batch_size = micro_batch_size
        self.vocab_size = vocab_size
        self.chunk_tokens = chunk_tokens
        self.max_tokens = max_tokens_per_micro_batch
        self.support_k, self.loss_temperature, self.max_row_tokens = support_k, loss_temperature, max_row_tokens
        if self.device == "cuda":
            self.max_tokens = self._size_micro_batches(process)

    @profiled
    @torch.no_grad()
    def score(self, batch: RolloutBatch, support_k: int | None, temperature: float = 1.0) -> TeacherScores:
        """support_k None: sampled-token log-probs only; 0 (or >= V): full distribution; K: top-K + tail.

        A batch with teacher prompts (data.teacher_demonstrations) is scored after those instead of its prompts.

        The support is at `temperature` (the loss temperature); sampled-token log-probs at 1. Rows are scored
        in token-budget micro-batches without inner padding (models/packing.py), the LM head on
        `chunk_tokens` response tokens at a time; positions outside the response mask score 0.
        Shapes: -> teacher_log_probs [B, Tr], support [B, Tr, K] (or [B, Tr, V]) and tail [B, Tr].
        MINIVERL_PROFILE_CALL=K profiles the K-th call where it runs (observe/profile.py).
        """
        return score_rows(
            self.model,
            batch,
            support_k,
            temperature,
            self.vocab_size,
            self.max_tokens,
            self.micro_batch_size,
            self.chunk_tokens,
            self.device,
        )

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _size_micro_batches(self, process: ProcessSettings, other_bytes: int = 0) -> int:
        """Tokens per teacher forward on a GPU: what this actor's memory share holds (models/sizing.py), at most
        the run's trainer.max_tokens_per_micro_batch when that is set; printed with its numbers. `other_bytes`:
        what other models in this process hold (several teachers in one scorer, workers/teachers.py). Refuses, with
        the arithmetic, a share that cannot hold one row beside the weights and an LM-head chunk."""
        from miniverl.models.memory import human
        from miniverl.models.sizing import check_scorer_fits, model_shape, scorer_chunk_entry_bytes
        from miniverl.models.vocab_kernels import kernels_available

        config = self.model.config
        shape = model_shape(config, self.vocab_size or config.vocab_size, self.weight_bytes() + other_bytes)
        share = memory_share_bytes(process)
        entry = scorer_chunk_entry_bytes(self.support_k, self.loss_temperature, shape.vocab, kernels_available())
        fits = check_scorer_fits(shape, share, self.chunk_tokens, entry, self.max_row_tokens)
        tokens = min(fits, self.max_tokens) if self.max_tokens else fits
        print(
            f"scorer: forwards of up to {tokens} tokens ({human(share)} share, {human(shape.weight_bytes)} of weights,"
            f" LM-head chunks of {self.chunk_tokens} tokens x {entry} B per logit)",
            flush=True,
        )
        return tokens

    def memory(self) -> dict[str, float]:
        return memory_report(self.device)


@torch.no_grad()
def score_rows(
    model,
    batch: RolloutBatch,
    support_k: int | None,
    temperature: float,
    vocab_size: int | None,
    max_tokens: int,
    micro_batch_size: int,
    chunk_tokens: int,
    device,
) -> TeacherScores:
    """ScorerWorker.score with `model` as the teacher (its arguments as the worker holds them): the scorer's own
    teacher, or the learner's student with its adapter disabled (model.teacher.path=self, LearnerWorker.score)."""
    batch = batch.teacher_view()  # privileged context: the teacher's own prompts before the same responses
    b, tr = batch.responses.shape
    v = vocab_size or model.config.vocab_size
    k = None if support_k is None else (v if support_k == 0 or support_k >= v else support_k)
    sampled = torch.zeros((b, tr), dtype=torch.float32, device=device)
    # A full-vocabulary support ([B, Tr, V] fp32, up to trainer.vocab_memory_budget_gib) is gathered on the CPU,
    # as the scores are handed over: it need not fit the scorer's GPU share beside the teacher.
    full = k is not None and k == v
    top_lp = None if k is None else torch.zeros((b, tr, k), dtype=torch.float32, device="cpu" if full else device)
    top_ids = None if k is None or k == v else torch.zeros((b, tr, k), dtype=torch.long, device=device)
    tail = None if top_ids is None else torch.zeros((b, tr), dtype=torch.float32, device=device)
    for rows in batch_micro_batches(batch, max_tokens, micro_batch_size):
        packed = pack_rows(batch, rows)
        with record_function("scorer/forward"):  # the phases a profile splits (bench/scorer_profile.py)
            hidden, head = packed_hidden(model, packed)  # [N, H]
        chunk = max(hidden.shape[0] if chunk_tokens <= 0 else chunk_tokens, 1)
        # Moved once per forward: a CPU index inside the chunk loop would wait for the GPU every chunk.
        rows_d, cols_d, targets_d = (t.to(device) for t in (packed.rows, packed.cols, packed.targets))
        for start in range(0, hidden.shape[0], chunk):
            at = slice(start, start + chunk)
            r, c = rows_d[at], cols_d[at]
            with record_function("scorer/head"):
                logits = head(hidden[at])[..., :v]  # [c, V_student], model dtype
                lse = row_logsumexp(logits)  # [c]: the sampled tokens' log-probs are at temperature 1
                sampled[r, c] = sampled_logprobs(logits, targets_d[at], lse)
            if k is None:
                continue
            with record_function("scorer/support"):
                if not full and temperature == 1.0:
                    # Top-K + tail straight from the logits (log-softmax is the logits minus one number per row,
                    # so their top K are the log-probs' top K): no fp32 copy of the chunk (vocab_kernels.py).
                    values, ids = logits.topk(k, dim=-1)  # [c, K]
                    top_lp[r, c], top_ids[r, c] = values.float() - lse[:, None], ids
                    logits.scatter_(1, ids, float("-inf"))
                    tail[r, c] = row_logsumexp(logits) - lse
                    continue
                logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [c, V]
                if full:
                    top_lp[packed.rows[at], packed.cols[at]] = logp.cpu()
                    continue
                values, ids = logp.topk(k, dim=-1)  # [c, K]
                top_lp[r, c], top_ids[r, c] = values, ids
                tail[r, c] = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), dim=-1)

    def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.cpu()

    with record_function("scorer/handover"):
        # int32 ids: half the bytes of the step's largest hand-over (GKD casts them back to long to gather)
        ids32 = None if top_ids is None else top_ids.to(torch.int32)
        return TeacherScores(sampled.cpu(), cpu(top_lp), cpu(ids32), cpu(tail), temperature)
