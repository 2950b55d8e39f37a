"""LearnerWorker: the student with a LoRA adapter, AdamW and the objective; publishes and checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from miniverl.checkpoint import save_checkpoint
from miniverl.models.loading import torch_dtype
from miniverl.models.logprobs import response_logits, token_logprobs
from miniverl.models.lora import LoraSettings, adapter_state, build_lora_model
from miniverl.protocol import (
    PolicyIdentity,
    PolicyMismatchError,
    PolicySnapshot,
    RolloutBatch,
    TeacherScores,
    weights_digest,
)
from miniverl.workers import ProcessSettings, memory_report, setup_process


class LearnerWorker:
    def __init__(
        self,
        model_path: str,
        lora: LoraSettings,
        dtype: str,
        objective,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        micro_batch_size: int,
        process: ProcessSettings,
    ) -> None:
        self.device = setup_process(process)
        self.model = build_lora_model(model_path, lora, torch_dtype(dtype, self.device), self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.objective = objective
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.version = 0  # number of optimizer steps taken; the policy after k updates is version k
        self.published: PolicyIdentity | None = None

    def publish_policy(self) -> PolicySnapshot:
        weights = adapter_state(self.model)
        self.published = PolicyIdentity(self.version, weights_digest(weights))
        return PolicySnapshot(self.published, weights)

    def update(self, batch: RolloutBatch, scores: TeacherScores, rewards: torch.Tensor | None) -> dict[str, float]:
        """One optimizer step on one strictly on-policy batch; refuses data of any other policy version."""
        if self.published is None or batch.policy_version != self.version or self.published.version != self.version:
            raise PolicyMismatchError(
                f"learner is at policy v{self.version} (published:"
                f" {self.published.short() if self.published else 'nothing'}) but the batch was sampled by"
                f" v{batch.policy_version}; strict sync trains only on rollouts of the policy it just published"
            )
        if scores.teacher_log_probs.shape != batch.responses.shape:
            raise ValueError("teacher scores do not match the rollout batch shape")
        ref = self._reference_logprobs(batch) if self.objective.needs_reference else None
        advantages = self.objective.prepare(batch, scores, rewards, ref)
        num_tokens = int(batch.response_mask.sum())
        sums = {"gap_abs": 0.0, "gap_max": 0.0, "loss": 0.0}
        extra: dict[str, float] = {}
        self.model.train()
        for start in range(0, len(batch), self.micro_batch_size):
            stop = start + self.micro_batch_size
            mb, sc = batch.rows(start, stop), scores.rows(start, stop)
            logits = response_logits(self.model, mb)  # [b, Tr, V]
            responses = mb.responses.to(logits.device)
            logprobs = token_logprobs(logits, responses)  # [b, Tr] fp32, grad flows
            adv = None if advantages is None else advantages[start:stop]
            loss, metrics = self.objective.loss(logits, logprobs, mb, sc, adv, num_tokens)
            loss.backward()
            mask = mb.response_mask.to(logprobs.device).bool()
            gap = (logprobs.detach() - mb.rollout_log_probs.to(logprobs.device)).abs()[mask]
            sums["gap_abs"] += gap.sum().item()
            sums["gap_max"] = max(sums["gap_max"], gap.max().item() if gap.numel() else 0.0)
            sums["loss"] += loss.item()
            weight = mask.sum().item() / num_tokens  # token-weighted mean of per-micro-batch means
            for k, v in metrics.items():
                extra[k] = extra.get(k, 0.0) + float(v) * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {
            "loss": sums["loss"],
            "grad_norm": float(grad_norm),
            "sampler_gap_mean": sums["gap_abs"] / max(num_tokens, 1),
            "sampler_gap_max": sums["gap_max"],
            "response_tokens": num_tokens,
            **extra,
        }

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The reference policy is the student with its adapter disabled. Shapes: -> [B, Tr] (CPU)."""
        out = []
        with self.model.disable_adapter():
            for start in range(0, len(batch), self.micro_batch_size):
                mb = batch.rows(start, start + self.micro_batch_size)
                logits = response_logits(self.model, mb)
                out.append(
                    (token_logprobs(logits, mb.responses.to(logits.device)) * mb.response_mask.to(logits.device)).cpu()
                )
        return torch.cat(out, dim=0)

    def save_checkpoint(self, directory: str) -> str:
        identity = self.published if self.published and self.published.version == self.version else None
        if identity is None:
            identity = PolicyIdentity(self.version, weights_digest(adapter_state(self.model)))
        return str(save_checkpoint(Path(directory), self.model, self.optimizer, identity))

    def memory(self) -> dict[str, float]:
        return memory_report(self.device)
