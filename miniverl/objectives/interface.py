"""The training objective's contract: what the scorer, the learner, the fused LM head and the conformance gate read of
an objective, written once (GkdObjective and PgK1Objective implement it; a new objective implements it to run).

Who reads what:
- the scorer (workers/scorer.py, through the controller): `teacher_support_k` and `loss_temperature`, the teacher's
  view it computes for the batch (batches.TeacherScores);
- the learner (workers/learner.py): `needs_reference` and `needs_current_logprobs`, the extra log-prob passes it runs
  before `prepare`, which turns the batch into per-token advantages (or None);
- the fused LM head (models/logprobs.py): `token_terms` (None when the loss needs only the sampled tokens'
  log-probs), `closed_form_head`, `token_loss`, and for objectives with terms `support_ids` / `support_terms`
  (SupportObjective below); the learner's memory model sizes the head's chunk by `closed_form_head`;
- the conformance gate and the per-step sampler check (step/conformance.py, objectives/sampler_check.py):
  `sampler_tolerance`;
- `loss_from_terms` gives the step's loss and metrics from the head's per-token results; `loss` is the same from
  whole logits (tests and the reference path).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from miniverl.objectives.ratios import SamplerTolerance


@runtime_checkable
class Objective(Protocol):
    """One training objective, built from its config section by `from_config` (objectives.build_objective)."""

    teacher_support_k: int | None  # None: the sampled tokens' teacher log-probs only; 0: the full vocabulary; K
    loss_temperature: float  # the temperature the scorer applies to the teacher's support
    needs_reference: bool  # `prepare` reads reference log-probs (the student with its adapter disabled)
    needs_current_logprobs: bool  # a batch one version behind: `prepare` reads the current policy's log-probs
    sampler_tolerance: SamplerTolerance  # the bounds on the sampler-learner log-prob gap
    closed_form_head: bool  # the fused LM head never runs autograd over [c, V]
    token_terms: Any  # (logits, scores) -> per-token terms [b, t], or None when the loss reads no logits

    @classmethod
    def from_config(cls, cfg) -> Objective: ...

    def prepare(
        self, batch, scores, rewards, ref_log_prob, current_log_probs=None
    ) -> torch.Tensor | None:  # advantages [B, Tr] or None
        ...

    def token_loss(self, logprobs, terms, sampler_logprobs, advantages, num_step_tokens) -> torch.Tensor: ...

    def loss_from_terms(self, logprobs, terms, batch, scores, advantages, num_step_tokens) -> tuple[Any, dict]: ...

    def loss(self, logits, logprobs, batch, scores, advantages, num_step_tokens) -> tuple[Any, dict]: ...


@runtime_checkable
class SupportObjective(Objective, Protocol):
    """An objective with per-token terms from the logits (`token_terms` not None): what the fused LM head's
    closed-form path reads besides."""

    def support_ids(self, scores) -> torch.Tensor | None:  # [b, t, K], or None: the terms need every logit
        ...

    def support_terms(self, student_support, student_tail, scores) -> torch.Tensor:  # [b, t, K], [b, t] -> [b, t]
        ...


def _declared(protocol: type) -> list[str]:
    """The members a protocol class declares itself: annotated attributes, then methods."""
    return [*inspect.get_annotations(protocol), *(n for n in vars(protocol) if not n.startswith("_"))]


def missing_members(objective) -> list[str]:
    """What `objective` lacks of the contract: Objective's members, and SupportObjective's when it has token terms."""
    names = _declared(Objective)
    if getattr(objective, "token_terms", None) is not None:
        names += _declared(SupportObjective)
    return [n for n in names if not hasattr(objective, n)]
