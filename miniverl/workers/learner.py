"""LearnerWorker: the student's update, one optimizer step of the objective on a batch, under its LoRA adapter.

The actor Ray serves (cluster/actors.py) is this class; what it composes lives beside it: publishing the adapter and
the strict-sync probe (workers/publisher.py), the sampler-gap check's bound, kept adapters and version test
(workers/sampler_gap.py), checkpoints (workers/learner_checkpoint.py), what it checks of a batch (workers/
batch_checks.py: the lag, the per-step sums) and its micro-batch token budget (workers/token_budget.py: sizing, the
shrink after an out-of-memory update).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miniverl.batches import RolloutBatch, TeacherScores, stack_rows
from miniverl.errors import NonFiniteError
from miniverl.models.loading import torch_dtype
from miniverl.models.logprobs import packed_logprobs, packed_token_loss
from miniverl.models.lora import LoraSettings, RoundedAdapter, build_lora_model
from miniverl.models.packing import batch_micro_batches, pack_rows, row_lengths
from miniverl.objectives.ratios import DEFAULT_IS_CAP, importance_ratio
from miniverl.objectives.sampler_check import SamplerGapError
from miniverl.observe.profile import CallProfile, profiled
from miniverl.policy import PolicyIdentity, PolicySnapshot
from miniverl.process import ProcessSettings, gpu_uuid, memory_report, setup_process
from miniverl.workers.batch_checks import StaleBatchError, check_lag, gap_sums, lag_metrics, sum_over_ranks
from miniverl.workers.learner_checkpoint import check_restored, restore_learner, save_learner
from miniverl.workers.publisher import PolicyPublisher
from miniverl.workers.sampler_gap import SamplerGapCheck
from miniverl.workers.token_budget import learner_shape, shrink_after_oom, size_micro_batches

if TYPE_CHECKING:
    from miniverl.objectives.interface import Objective

# Callers import these from here; they live in errors.py and the learner's helper modules.
__all__ = ["LearnerWorker", "NonFiniteError", "StaleBatchError", "learner_shape"]


@dataclass
class StepGap:
    """The step's sampler gap on this rank: |learner - sampler| log-prob (nats) of each response token, their sum,
    largest and count beyond the bound's tail, and the version test's votes."""

    tokens: torch.Tensor  # [n] this rank's response tokens
    abs_sum: float
    largest: float
    tail: int
    votes: list[float]

    def metrics(self, num_tokens: int) -> dict[str, float]:
        return {
            "sampler_gap_mean": self.abs_sum / max(num_tokens, 1),
            "sampler_gap_max": self.largest,
            "sampler_gap_p99": float(torch.quantile(self.tokens.float(), 0.99)) if self.tokens.numel() else 0.0,
            "sampler_gap_tail_frac": self.tail / max(num_tokens, 1),
        }


class LearnerWorker:
    def __init__(
        self,
        model_path: str,
        lora: LoraSettings,
        dtype: str,
        objective: Objective,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        micro_batch_size: int,
        process: ProcessSettings,
        rank: int = 0,
        world_size: int = 1,
        on_nonfinite: str = "stop",
        quantization: str = "none",
        logprob_chunk_tokens: int = 0,
        gradient_checkpointing: bool = False,
        max_tokens_per_micro_batch: int = 0,
        max_row_tokens: int = 0,
        staleness: int = 0,
        loss_weight_by_source: dict[str, float] | None = None,
        compile_layers: bool = False,
    ) -> None:
        """The last four come from the run (model.student.quantization, trainer.logprob_chunk_tokens,
        trainer.gradient_checkpointing, trainer.max_tokens_per_micro_batch): `quantization` nf4 loads a 4-bit
        base under the adapter (QLoRA); the LM head and the loss run on `logprob_chunk_tokens` response tokens
        at a time (0: a micro-batch's at once; models/fused_head.py); `gradient_checkpointing` recomputes
        decoder activations; a micro-batch holds at most `max_tokens_per_micro_batch` padded tokens (0: sized
        from this actor's memory share on a GPU, models/sizing.py; `micro_batch_size` rows of the batch's
        longest on the CPU; models/packing.py). `max_row_tokens`: the longest row the run can produce
        (prompt limit + new tokens), which a GPU share must hold. `staleness` (trainer.staleness): policy
        versions a batch may lag this learner; with 1 the learner keeps the adapter of the last published
        versions, to hold a lagging batch's sampler to the version that sampled it. `loss_weight_by_source`
        (trainer.loss_weight_by_source): data_source -> weight of its rows' token losses, 1 for the rest; empty
        or None computes the loss exactly as without it. `compile_layers` (trainer.compile_layers): each decoder
        layer through torch.compile (models/compiled.py)."""
        self.device = setup_process(process)
        self.profile = CallProfile(f"learner{rank}", self.device)  # MINIVERL_PROFILE_CALL (observe/profile.py)
        self.rank, self.world_size = rank, world_size
        self.model = build_lora_model(model_path, lora, torch_dtype(dtype, self.device), self.device, quantization)
        if gradient_checkpointing:
            # Non-reentrant checkpointing propagates gradients into the adapter even though the frozen
            # embeddings' outputs do not require grad (the reentrant kind would need enable_input_require_grads).
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.compiled = compile_layers
        if compile_layers:
            from miniverl.models.compiled import compile_decoder_layers

            count = compile_decoder_layers(self.model)
            print(
                f"learner: {count} decoder layers compiled (trainer.compile_layers): the first update compiles",
                flush=True,
            )
        self.chunk_tokens = logprob_chunk_tokens
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.objective = objective
        self.sampler_gap = SamplerGapCheck(objective.sampler_tolerance)  # its bound and the versions' adapters
        self.publisher = PolicyPublisher(self.model, self.params)
        self.dropout = lora.dropout  # > 0: the training forward is not the policy; the gap takes an eval forward
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens_per_micro_batch
        if self.device == "cuda":
            self.max_tokens = size_micro_batches(
                self.model,
                process,
                self.max_tokens,
                self.chunk_tokens,
                gradient_checkpointing,
                max_row_tokens,
                objective.closed_form_head,
                compile_layers,
            )
        self.version = 0  # number of optimizer steps taken; the policy after k updates is version k
        self.published: PolicyIdentity | None = None
        self.on_nonfinite = on_nonfinite  # skip | stop (trainer.on_nonfinite)
        self.staleness = staleness
        self.loss_weight_by_source = dict(loss_weight_by_source or {})
        self.window = (0.0, 0.0)  # wall-clock start and end (epoch s) of the last update call

    def distributed_address(self) -> tuple[str, int]:
        """Host and a free port for rank 0 to host the process-group rendezvous."""
        import socket

        from ray.util import get_node_ip_address

        with socket.socket() as sock:
            sock.bind(("", 0))
            return get_node_ip_address(), sock.getsockname()[1]

    def init_distributed(self, host: str, port: int) -> None:
        """Join the data-parallel group: gloo on the CPU, NCCL on GPUs (NVLink multicast stays off)."""
        import os

        import torch.distributed as dist

        # NVLink multicast (NVLS) can take a shared host's GPUs out of service; never let NCCL use it.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world_size)

    def publish_policy(self, include_weights: bool = True, on_device: bool = False) -> PolicySnapshot:
        """The policy's identity (its name: version and the digest of the weights, computed by the learner
        alone), and its weights unless only the identity is needed (ranks > 0): CPU copies, or with
        `on_device` (every replica on this GPU: miniverl/step/sync.py) one flat buffer in this GPU's memory
        that the replicas map by its CUDA IPC handle (miniverl/policy.py): no adapter-sized host copy.
        The adapter is kept for the sampler-gap check of this version's batches (workers/sampler_gap.py)."""
        snapshot, kept = self.publisher.publish(self.version, include_weights, on_device)
        self.published = snapshot.identity
        self.sampler_gap.keep(self.version, kept, self.staleness)
        return snapshot

    def device_uuid(self) -> str | None:
        """The physical GPU this learner computes on (None on the CPU): sync publishes on the device when
        every rollout replica reports the same one."""
        return gpu_uuid(self.device)

    def probe_sequences(self) -> list[list[int]]:
        """The run's fixed strict-sync probe, drawn from this student's vocabulary (workers/publisher.py)."""
        return self.publisher.probe_sequences()

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The learner's log-probs of the probe under the current policy (peft model, eval mode, no grad)."""
        return self.publisher.probe_logprobs(sequences)

    def trial_snapshot(self, seed: int, std: float) -> PolicySnapshot:
        """A non-zero adapter for the conformance gate under version -1 (workers/publisher.py)."""
        return self.publisher.trial_snapshot(seed, std)

    def probe_logprobs_with(self, snapshot: PolicySnapshot, sequences: list[list[int]]) -> list[list[float]]:
        """probe_logprobs under another adapter (a trial snapshot's), then the learner's own is put back."""
        return self.publisher.probe_logprobs_with(snapshot, sequences)

    @profiled
    def update(
        self,
        batch: RolloutBatch,
        scores: TeacherScores,
        rewards: torch.Tensor | None,
        num_step_tokens: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step on a batch of a policy version this learner published, at most
        `staleness` versions behind it (strict sync: exactly the current one); refuses any other.

        With several data-parallel ranks, each gets a shard of whole groups and `num_step_tokens`, the
        response tokens of the whole step: gradients are summed across ranks, so the step equals the
        single-rank step on the full batch. Metrics are this rank's sums over the step's tokens.

        A lagging batch (sampled by v < the learner's version; docs/objectives.md, "One-step-stale
        rollouts"): the sampler-gap check compares the sampler with the learner's log-probs under the
        version that sampled (its adapter kept since it was published), and the change since then is
        reported as `policy_drift_*`; PG-k1's advantage takes the current policy's log-probs, its importance
        ratio stays against the sampler's; the step's `reverse_kl` is importance-weighted to the current policy.

        MINIVERL_PROFILE_CALL=K profiles the K-th update where it runs (observe/profile.py).
        """
        start = time.time()
        lag = self._check_batch(batch, scores)
        advantages, behaviour = self._prepare(batch, scores, rewards, lag)
        num_tokens = int(batch.response_mask.sum()) if num_step_tokens is None else num_step_tokens
        prepared = time.time()
        loss_sum, logprobs, terms = self._backward(batch, scores, advantages, num_tokens)
        backward = time.time()
        objective_metrics = self._objective_metrics(batch, scores, advantages, logprobs, terms, num_tokens)
        gap = self._sampler_gap(batch, logprobs, behaviour)
        loss = loss_sum.item()
        reverse_kl = self._reverse_kl(batch, scores, logprobs, lag)
        version_z = self._check_step(gap, num_tokens, batch.policy_version)
        checked = time.time()
        grad_norm, skipped = self._apply(loss)
        self.window = (start, time.time())
        return {
            **update_split(start, prepared, backward, checked, self.window[1]),
            "skipped_step": float(skipped),
            "loss": loss,
            "grad_norm": grad_norm,
            **gap.metrics(num_tokens),
            # the version test: z of 'the sampler sits nearer the previous version / the base model than the batch's
            # version' (< 0: it does not; 0: not voted); the tokens it recomputed
            **version_z,
            "response_tokens": num_tokens,
            "micro_batch_tokens": float(self.max_tokens),  # 0: row-count micro-batches; drops after an OOM
            "reverse_kl": reverse_kl / max(num_tokens, 1),
            **objective_metrics,
            **lag_metrics(self._drift(batch, logprobs), num_tokens, self.staleness),
        }

    def _check_batch(self, batch: RolloutBatch, scores: TeacherScores) -> int:
        """Refuse a batch of a version this learner did not publish, or one lagging more than `staleness`, and
        scores of another shape; returns the batch's lag (0: sampled by the current version)."""
        lag = check_lag(self.version, self.published, batch.policy_version, self.staleness, self.sampler_gap.behaviour)
        if scores.teacher_log_probs.shape != batch.responses.shape:
            raise ValueError("teacher scores do not match the rollout batch shape")
        return lag

    def _prepare(
        self, batch: RolloutBatch, scores: TeacherScores, rewards: torch.Tensor | None, lag: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The forwards before the gradients and the objective's advantages: the reference policy's log-probs
        where the objective needs them; the learner's log-probs of the sampled tokens under the version that sampled
        them (`behaviour`, None at lag 0 without dropout: then the update's own are those) and, for PG-k1's
        advantage, under the current one (None at lag 0: the update's own). Returns (advantages, behaviour)."""
        ref = self._reference_logprobs(batch) if self.objective.needs_reference else None
        behaviour = None
        if lag:
            with self.publisher.swapped(self.sampler_gap.behaviour[batch.policy_version]):
                behaviour = self.sampled_logprobs(batch)
        elif self.dropout:  # the update's own forward drops adapter inputs: the gap is taken on the policy itself
            behaviour = self.sampled_logprobs(batch)
        current = self.sampled_logprobs(batch) if lag and self.objective.needs_current_logprobs else None
        return self.objective.prepare(batch, scores, rewards, ref, current), behaviour

    def _backward(self, batch: RolloutBatch, scores: TeacherScores, advantages, num_tokens: int):
        """The step's gradients over its micro-batches, redone at a lower token budget after an out-of-memory
        error; the loss sum (on the device) and the per-token log-probs and terms, [B, Tr] on the CPU."""
        row_weights = self._row_weights(batch)  # [B] or None
        self.model.train()
        while True:
            try:
                loss_sum, logprobs, terms = self._gradients(batch, scores, advantages, num_tokens, row_weights)
                break
            except torch.OutOfMemoryError as oom:
                error = str(oom)
            self._shrink_after_oom(batch, error)  # outside the handler: its traceback holds the failed tensors
        return loss_sum, logprobs.cpu(), (None if terms is None else terms.cpu())  # .cpu() waits for the micro-batches

    def _objective_metrics(self, batch, scores, advantages, logprobs, terms, num_tokens: int) -> dict[str, float]:
        """The objective's metrics over this rank's rows, as a share of the step's tokens (ranks' shares add up)."""
        with torch.no_grad():
            _, metrics = self.objective.loss_from_terms(logprobs, terms, batch, scores, advantages, num_tokens)
        weight = int(batch.response_mask.sum()) / num_tokens
        return {k: float(v) * weight for k, v in metrics.items()}

    def _sampler_gap(self, batch: RolloutBatch, logprobs: torch.Tensor, behaviour: torch.Tensor | None) -> StepGap:
        """How far the sampler's log-probs of this rank's tokens sit from the learner's under the version that
        sampled them, and the version test's votes (their extra forwards)."""
        recomputed = logprobs if behaviour is None else behaviour  # the learner's, under the sampling version
        tokens = (recomputed - batch.rollout_log_probs).abs()[batch.response_mask.bool()]
        abs_sum, largest, tail = gap_sums(tokens, self.sampler_gap.bound.tail)
        votes = self.sampler_gap.version_votes(batch, recomputed, self.publisher, self.sampled_logprobs)
        return StepGap(tokens, abs_sum, largest, tail, votes)

    @staticmethod
    def _reverse_kl(batch: RolloutBatch, scores: TeacherScores, logprobs: torch.Tensor, lag: int) -> float:
        """The k1 reverse-KL estimate of the step (controller.rollout_metrics' formula), here because the teacher's
        scores come straight from the scorer: a sum over this rank's tokens (the caller divides by the step's).
        A lagging batch's tokens come from an older policy: its estimate of the current policy's reverse KL weighs
        each token's log-ratio by the truncated importance ratio q_theta / q_sampler."""
        if lag:
            w = importance_ratio(logprobs, batch.rollout_log_probs).clamp(max=DEFAULT_IS_CAP)  # [B, Tr]
            k1 = w * (logprobs - scores.teacher_log_probs)
        else:
            k1 = batch.rollout_log_probs - scores.teacher_log_probs
        return float((k1 * batch.response_mask).sum())

    def _check_step(self, gap: StepGap, num_tokens: int, version: int) -> dict[str, float]:
        """Sum the gradients over the ranks, then refuse the step when the sampler's gap or the version test fails
        (_check_sampler_gap); returns the version test's metrics."""
        if self.world_size > 1:
            self._sum_gradients()
        return self._check_sampler_gap(gap.abs_sum, gap.largest, gap.tail, gap.votes, num_tokens, version)

    def _apply(self, loss: float) -> tuple[float, bool]:
        """Clip the gradients and take the optimizer step unless a value is not finite; (grad norm, skipped)."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        return grad_norm, self._step_if_finite(loss, grad_norm)

    @staticmethod
    def _drift(batch: RolloutBatch, logprobs: torch.Tensor) -> torch.Tensor:
        """log of q_theta / q_sampler on this rank's tokens: how far the policy updated now is from the sampler."""
        return (logprobs - batch.rollout_log_probs)[batch.response_mask.bool()]

    def update_parts(
        self,
        batch: RolloutBatch,
        rewards: torch.Tensor | None,
        num_step_tokens: int,
        start: int,
        stop: int,
        *scores: TeacherScores,
    ) -> dict[str, float]:
        """`update` when this rank's rows are not one scorer replica's part: `scores` are the parts that hold them,
        in row order, and this rank's rows are [start, stop) of them stacked (batches.stack_rows). Each part is an
        argument of its own, so through Ray every one arrives here from its scorer by reference, never through the
        driver (a ref inside a list would reach the actor unresolved)."""
        return self.update(batch, stack_rows(list(scores), start, stop), rewards, num_step_tokens)

    def _gradients(self, batch, scores, advantages, num_tokens, row_weights):
        """Accumulate the step's gradients over its micro-batches; the loss sum and the per-token log-probs and
        terms, [B, Tr] on the device (filled per micro-batch: one copy back, no sync per micro-batch). The adapter
        is rounded to the base's dtype once for all of them (models/lora.py RoundedAdapter)."""
        logprobs = torch.zeros(batch.responses.shape, dtype=torch.float32, device=self.device)
        terms = None if self.objective.token_terms is None else torch.zeros_like(logprobs)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        with RoundedAdapter(self.model, all_used=self.compiled) as rounded:
            for rows in batch_micro_batches(batch, self.max_tokens, self.micro_batch_size):
                packed = pack_rows(batch, rows)
                loss, lp, term = packed_token_loss(
                    self.model,
                    batch,
                    packed,
                    scores,
                    self.objective,
                    advantages,
                    num_tokens,
                    self.chunk_tokens,
                    row_weights,
                )
                loss.backward()
                rounded.collect()
                loss_sum += loss.detach()
                at = (packed.rows.to(self.device), packed.cols.to(self.device))
                logprobs[at] = lp
                if terms is not None:
                    terms[at] = term
        return loss_sum, logprobs, terms

    def _shrink_after_oom(self, batch: RolloutBatch, error: str) -> None:
        """After an out-of-memory error inside the micro-batches (nothing applied yet): drop the step's partial
        gradients and redo at a lower token budget, kept for every later step (workers/token_budget.py)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.max_tokens = shrink_after_oom(
            self.max_tokens, self.world_size, max(row_lengths(batch)), error, self.device
        )

    def _row_weights(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Each row's loss weight by its data_source (trainer.loss_weight_by_source, 1 when not named); None
        without weights, so an unweighted run multiplies nothing. Shapes: -> [B] float32."""
        if not self.loss_weight_by_source:
            return None
        return torch.tensor([self.loss_weight_by_source.get(s, 1.0) for s in batch.data_source], dtype=torch.float32)

    def busy_window(self) -> tuple[float, float]:
        """When the last update ran (wall-clock epoch seconds, this host's clock; see RolloutWorker.busy_window)."""
        return self.window

    def calibrate_sampler_gap(self, gate_mean: float, gate_p99: float, gate_std: float) -> dict[str, float | str]:
        """Hold every later step to the bound calibrated from the conformance gate's honest gap (nats; see
        SamplerGapCheck.calibrate). Returns the bound."""
        return self.sampler_gap.calibrate(gate_mean, gate_p99, gate_std)

    def sampled_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The sampled tokens' log-probs under the current adapter as an update computes them (its micro-batches
        and packing), dropout off: what the sampler's log-probs are held to. Shapes: -> [B, Tr] (CPU)."""
        self.model.eval()
        try:
            return self.policy_logprobs(batch)
        finally:
            self.model.train()

    def _check_sampler_gap(
        self, gap_abs: float, gap_max: float, gap_tail: int, votes: list[float], num_tokens: int, version: int
    ) -> dict[str, float]:
        """Refuse the step before optimizer.step() when the sampler's log-probs of the step's tokens sit further
        from the learner's than this run's bound (`sampler_gap.bound`: calibrated at the conformance gate from the
        honest gap of this backend and dtype, else the objective's): the mean, or the share of tokens beyond its
        tail; or when they sit nearer the learner's previous version or its base model than the batch's `version`
        (the version test, `votes`); or when the steps' gaps or votes so far, added up, sit above the honest ones
        beyond what chance allows (objectives/sequential_check.py). Every rank sees the whole step. Returns the
        version test's metrics (each comparison's z, mean vote / its error, and the tokens it recomputed) and the
        sequential tests' step z and statistics."""
        if self.world_size > 1:
            gap_abs, gap_max, gap_tail, votes = sum_over_ranks(gap_abs, gap_max, gap_tail, votes, self.device)
        try:  # the per-step bound, the version test, then the evidence of the run's steps so far (gap_cusum.py)
            return self.sampler_gap.judge(gap_abs, gap_max, gap_tail, votes, num_tokens, version, self.version)
        except SamplerGapError:
            self.optimizer.zero_grad(set_to_none=True)  # nothing of this step reaches the adapter
            raise

    def _sum_gradients(self) -> None:
        """All-reduce (sum) the adapter gradients; each rank's loss is already divided by the step's tokens."""
        import torch.distributed as dist

        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def score(self, batch: RolloutBatch, support_k: int | None, temperature: float = 1.0) -> TeacherScores:
        """The teacher's scores when the teacher is the student's own base (model.teacher.path=self): ScorerWorker.score
        with this learner's model, its LoRA adapter disabled and dropout off, in the update's micro-batches, after the
        batch's teacher prompts where it has them (data.teacher_demonstrations). The controller calls it as it calls a
        scorer (cluster/launch.py hands the learners over as the scorers): no second model, no scorer process."""
        from miniverl.workers.scorer import score_rows

        self.model.eval()
        try:
            with self.model.disable_adapter():
                return score_rows(
                    self.model,
                    batch,
                    support_k,
                    temperature,
                    None,  # the student's own vocabulary
                    self.max_tokens,
                    self.micro_batch_size,
                    self.chunk_tokens,
                    self.device,
                )
        finally:
            self.model.train()

    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The reference policy is the student with its adapter disabled. Shapes: -> [B, Tr] (CPU)."""
        with self.model.disable_adapter():
            return self.policy_logprobs(batch)

    @torch.no_grad()
    def policy_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The sampled tokens' log-probs under the model as it is now (adapter and mode as set), without gradient,
        in the update's micro-batches. Shapes: -> [B, Tr] (CPU)."""
        out = torch.zeros(batch.responses.shape, dtype=torch.float32)
        for rows in batch_micro_batches(batch, self.max_tokens, self.micro_batch_size):
            packed = pack_rows(batch, rows)
            out[packed.rows, packed.cols] = packed_logprobs(self.model, packed, self.chunk_tokens).cpu()
        return out

    def _step_if_finite(self, loss: float, grad_norm: float) -> bool:
        """Apply the optimizer step unless the loss or a gradient is NaN/inf; returns True when skipped.

        A non-finite value is never applied (it would poison the adapter for every later step): `skip`
        drops this step's gradients and keeps the policy and its version; `stop` raises. With several
        ranks the gradient norm is the same on all of them (gradients are summed first), so every rank
        takes the same branch.
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
            return False
        self.optimizer.zero_grad(set_to_none=True)
        if self.on_nonfinite == "skip":
            return True
        raise NonFiniteError(
            f"the learner's loss ({loss}) or gradient norm ({grad_norm}) is not finite at policy v{self.version};"
            " the update was not applied and the adapter is unchanged. Lower trainer.lr, check the data, or set"
            " trainer.on_nonfinite=skip to drop such steps"
        )

    def save_checkpoint(self, directory: str, meta: dict | None = None) -> str:
        """Write adapter, optimizer, RNG states and `meta` (step, config) atomically; refuses a poisoned adapter."""
        return save_learner(directory, self.model, self.optimizer, self.version, meta)

    def load_checkpoint(self, directory: str) -> PolicyIdentity:
        """Restore adapter, optimizer, policy version and RNG states; the restored weights must hash to the
        digest the checkpoint recorded. The next publish_policy serves this policy to the rollout side."""
        state = restore_learner(directory, self.model, self.optimizer, self.device)
        self.version = int(state["policy_version"])
        self.published = None
        self.sampler_gap.forget()  # a batch sampled before the checkpoint is never trained on after it
        return check_restored(directory, self.model, self.version, state["policy_digest"])

    def memory(self) -> dict[str, float]:
        return memory_report(self.device)


UPDATE_PARTS = ("prepare", "gradients", "checks", "optimizer")


def update_split(*marks: float) -> dict[str, float]:
    """`time/update/<part>`: the update's own split, on the learner's clock, from its five marks. prepare: the
    reference policy's and lagging batches' extra forwards and the objective's advantages; gradients: every
    micro-batch's forward and backward (it ends when their log-probs reach the host); checks: the sampler-gap and
    version checks (their extra forwards), the metrics and, with several ranks, the gradients' all-reduce;
    optimizer: clipping and the optimizer step. The rest of the controller's `time/update` is the round trip."""
    return {f"time/update/{part}": b - a for part, a, b in zip(UPDATE_PARTS, marks, marks[1:])}
