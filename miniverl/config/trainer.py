"""The trainer section: steps, optimiser, the learner's memory layout, evaluation, checkpoints and sync cadence."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from miniverl.config.base import require

NONFINITE_POLICIES = ("skip", "stop")
STALENESS_LEVELS = (0, 1)  # trainer.staleness: policy versions a batch may lag the learner
PROBE_EVERY = 16  # trainer.probe_every's default (miniverl/step/sync.py takes it from here too)


@dataclass
class TrainerConfig:
    total_steps: int = 400
    lr: float = 2e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # Rows per forward/backward when max_tokens_per_micro_batch is 0; the loss is normalized per optimizer step,
    # so the split never changes a number.
    micro_batch_size: int = 16
    # Padded tokens (rows x longest row, prompt + response) per forward in the learner and the scorer: rows are
    # sorted by length and grouped under this budget, laid out without inner padding (models/packing.py).
    # 0 = micro_batch_size rows of the step's longest row.
    max_tokens_per_micro_batch: int = 0
    # Response tokens whose [tokens, V] logits exist at once in the learner (and the scorer): the LM head and
    # the loss run fused, chunk by chunk, forward and backward (models/fused_head.py), so no [rows, Tr, V]
    # tensor exists. 0 = a whole micro-batch's tokens at once (fine for tiny vocabularies). null = chosen before
    # Ray: 0 on the CPU and for vocabularies under 32k; on a GPU the largest of 1024/512/256/128 with which the
    # learner and the scorer fit their shares (setup/layout.py choose_layout; the run prints the choice and why).
    logprob_chunk_tokens: int | None = None
    # Recompute decoder activations in backward (less memory, ~30% more compute per token). null = chosen before
    # Ray: off on the CPU; on a GPU on when without it the learner's micro-batches would be short (under 16k tokens
    # and the step's), so the few large micro-batches it allows are faster than many small ones.
    gradient_checkpointing: bool | None = None
    # Each decoder layer of the learner through torch.compile (miniverl/models/compiled.py): about half the kernel
    # launches of an update whose time is launches and Python; the first update compiles (about 75 s at 0.5B). On an
    # H200: 1.68x the eager learner's tokens/s (lab/results/learner-throughput.md, 2026-12-03), update 1.97 s against
    # 3.71 in the 12 GiB recipe. null = chosen before Ray: off on the CPU; on a GPU with Triton on for an unquantized
    # student of a tested model type (Qwen2) and size, off with the reason otherwise (setup/layout.py choose_layout
    # prints it). Validation refuses true with an NF4 student (untested). Beside a colocated one-behind rollout the
    # compiled learner's calls and the rollout's CUDA-graph captures take turns (cluster/colocate.py): Inductor
    # synchronizes the device as it compiles.
    compile_layers: bool | None = None
    # The largest vocabulary-sized buffer the run may hold (GiB): the teacher's full-vocabulary support of a
    # step (objective.teacher_topk=0) and the learner's direct-path logits are refused above it, with the
    # arithmetic (miniverl/models/memory.py).
    vocab_memory_budget_gib: float = 4.0
    eval_every: int = 100  # steps between evaluations (0 = only before and after training)
    eval_samples: int = 4  # prompt/response/reward rows per evaluation to samples.jsonl and a wandb table
    save_checkpoint: bool = True  # false: no checkpoints at all (a stopped run cannot be resumed)
    # Checkpoints go to <run dir>/checkpoints/step_<k>/ every save_every steps and after the last step
    # (0 = only after the last step); the newest keep_checkpoints of them are kept.
    save_every: int = 100
    keep_checkpoints: int = 2
    # none: start fresh (a run directory that already holds a run is refused); auto: continue the newest
    # valid checkpoint in the run directory, or start fresh if it holds none; a path: continue that checkpoint.
    resume: str = "none"
    # A resumed run continues under its saved config plus what the command line sets now; a change of data,
    # model, objective, reward or sampling (rollout.*) is refused unless this is true (checkpoints/compat.py).
    resume_allow_changes: bool = False
    # A non-finite loss or gradient: skip (drop this optimizer step, the policy stays as it was) or stop
    # (end the run with an error). Either way the poisoned update is never applied, published or saved.
    on_nonfinite: str = "stop"
    # Policy versions a training batch may lag the learner it updates (docs/objectives.md, "One-step-stale
    # rollouts"). 0: strict sync, every batch comes from the policy just published. 1: the rollout of step k+1
    # (sampled from v_k, proven served) and its scoring run while the learner updates on step k's batch.
    staleness: int = 0
    # Strict sync proves every refresh (miniverl/step/sync.py). A rollout engine that serves from adapter buffers
    # of its own (hf_reference, hf_cached) digests them after every load, and the digest must be the learner's:
    # O(adapter) work, exact in any dtype. The probe (log-probs of a few sequences through the serving path
    # against the learner's: O(model) work on both sides) proves the base model and the arithmetic, which do not
    # change between refreshes: it runs at the first refresh, on the conformance gate's trial adapter, and on
    # every probe_every-th refresh after that; at every refresh of an engine without a served digest (vLLM).
    # 1 = probe every refresh.
    probe_every: int = PROBE_EVERY
    # data_source -> weight of its rows' tokens in the step loss (sources not named weigh 1). The loss stays a sum
    # over the step's tokens divided by their count, so {sort: 4} counts a sorting token four times; empty (the
    # default) leaves the loss as it always was. docs/multi_teacher.md says why a mixture may need it.
    loss_weight_by_source: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        """The trainer's own values. max_tokens_per_micro_batch is measured against data and rollout lengths, and
        loss_weight_by_source's keys against data.task, in check_combinations."""
        from miniverl.seeds import STEP_STRIDE

        require(
            self.total_steps > 0,
            f"trainer.total_steps={self.total_steps}: need at least 1 step (e.g. trainer.total_steps=60)",
        )
        require(self.micro_batch_size > 0, f"trainer.micro_batch_size={self.micro_batch_size}: must be >= 1")
        require(
            self.total_steps < STEP_STRIDE,
            f"trainer.total_steps={self.total_steps}: sampling seeds are unique for fewer than {STEP_STRIDE} steps"
            " (miniverl/seeds.py); split the run",
        )
        require(
            self.eval_every >= 0,
            f"trainer.eval_every={self.eval_every}: use 0 (start and end only) or a positive step count",
        )
        require(self.lr > 0, f"trainer.lr={self.lr}: must be > 0")
        require(
            self.save_every >= 0,
            f"trainer.save_every={self.save_every}: use 0 (only after the last step) or a positive step count",
        )
        require(
            self.keep_checkpoints >= 1,
            f"trainer.keep_checkpoints={self.keep_checkpoints}: keep at least 1 (resume needs one)",
        )
        require(
            self.on_nonfinite in NONFINITE_POLICIES,
            f"trainer.on_nonfinite={self.on_nonfinite!r}: use {' or '.join(NONFINITE_POLICIES)}",
        )
        require(bool(self.resume), "trainer.resume is empty: use none, auto or a checkpoint directory")
        require(
            self.staleness in STALENESS_LEVELS,
            f"trainer.staleness={self.staleness}: use 0 (strict sync) or 1 (the next rollout overlaps the update, one"
            " policy version behind); a larger lag is not supported (its importance correction and resume are not"
            " built)",
        )
        require(
            self.probe_every >= 1,
            f"trainer.probe_every={self.probe_every}: use 1 (probe every refresh) or N > 1 (every N-th; each refresh"
            " is still proven by the replica's served digest where its engine has one)",
        )
        for source, weight in self.loss_weight_by_source.items():
            require(
                isinstance(weight, int | float) and math.isfinite(weight) and weight > 0,
                f"trainer.loss_weight_by_source.{source}={weight}: a weight must be a finite number > 0 (1 = as"
                " unweighted; to drop a source, leave its rows out of the data)",
            )
        require(
            self.logprob_chunk_tokens is None or self.logprob_chunk_tokens >= 0,
            f"trainer.logprob_chunk_tokens={self.logprob_chunk_tokens}: use 0 (a micro-batch at once), a token count"
            " such as 256, or null (chosen from the model and the memory share)",
        )
        require(
            self.vocab_memory_budget_gib > 0,
            f"trainer.vocab_memory_budget_gib={self.vocab_memory_budget_gib}: must be > 0 (GiB)",
        )
        require(self.eval_samples >= 0, f"trainer.eval_samples={self.eval_samples}: must be >= 0")
