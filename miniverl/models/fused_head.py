"""The LM head fused with the loss: per-token losses from final hidden states, one chunk of logits at a time.

The learner needs, for every response token, the policy's log-prob of the sampled token and (for GKD) a
divergence against the teacher's support: both are functions of that position's [V] logits. At a 152k
vocabulary those logits, their fp32 upcast and their gradient are what fill a 16 GB card. Here they exist for
`chunk_tokens` positions at a time, forward *and* backward:

- forward, per chunk of positions: logits = head(hidden[chunk]) [c, V]; log-probs, the objective's term and
  its per-token loss from them; the gradient of that loss with respect to the chunk's logits right away
  (torch.autograd.grad on the chunk's own small graph), turned into the gradient with respect to the
  chunk's hidden states (dlogits @ W, [c, H]); then the chunk's logits are freed;
- backward: the stored [N, H] gradient, scaled by the incoming one.

This is possible because every objective's loss is a *sum of per-token contributions*, each depending only
on its own position's logits (GKD: term_t / N; PG-k1: -w_t A_t rho_t / N with w_t from that token's ratio),
so a chunk's gradient is complete once the chunk is computed. Against the checkpointed chunks it replaces
(forward, recompute, backward: three LM-head products and their [c, V] buffers) it computes the head twice
and keeps nothing vocabulary-sized between chunks. Liger-Kernel's fused linear losses use the same idea; this
is written for miniVERL's objectives and checked against the direct path (tests/models/test_fused_head.py).

Shapes: N response tokens (flattened over rows), H hidden, V vocabulary, c = chunk_tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (logits [1, c, V] in the model's dtype, positions) -> the objective's per-token term [1, c]
TermFn = Callable[[torch.Tensor, slice], torch.Tensor]
# (logprobs [c] fp32, terms [c] or None, positions) -> per-token loss contributions [c]; the loss is their sum
LossFn = Callable[[torch.Tensor, torch.Tensor | None, slice], torch.Tensor]


def chunk_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at `ids` in fp32, temperature 1. Shapes: logits [c, V], ids [c] -> [c] float32."""
    logits = logits.float()
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_values(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    positions: slice,
    term_fn: TermFn | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's logits [c, V], sampled-token log-probs [c] and objective terms [c] (or None)."""
    logits = F.linear(hidden, weight, bias)  # [c, V], model dtype
    logprobs = chunk_logprobs(logits, ids[positions])
    terms = None if term_fn is None else term_fn(logits.unsqueeze(0), positions).squeeze(0)
    return logits, logprobs, terms


class _FusedHeadLoss(torch.autograd.Function):
    """Sum of per-token losses through the LM head; backward returns the gradient computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, chunk_tokens, term_fn, loss_fn):
        grad_hidden = torch.empty_like(hidden)  # [N, H]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
        terms = None if term_fn is None else torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], chunk_tokens):
            positions = slice(start, min(start + chunk_tokens, hidden.shape[0]))
            with torch.enable_grad():
                h = hidden[positions].detach().requires_grad_()  # [c, H]
                _, lp, term = _chunk_values(h, weight, bias, ids, positions, term_fn)
                chunk_loss = loss_fn(lp, term, positions).sum()
                (grad_hidden[positions],) = torch.autograd.grad(chunk_loss, h)  # [c, H]: dlogits @ W, then freed
            total += chunk_loss.detach()
            logprobs[positions] = lp.detach()
            if terms is not None:
                terms[positions] = term.detach()
        ctx.save_for_backward(grad_hidden)
        if terms is None:
            terms = torch.empty(0, device=hidden.device)
        ctx.mark_non_differentiable(logprobs, terms)
        return total, logprobs, terms

    @staticmethod
    def backward(ctx, grad_total, _grad_logprobs, _grad_terms):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None


def fused_head_loss(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    ids: torch.Tensor,
    chunk_tokens: int,
    term_fn: TermFn | None,
    loss_fn: LossFn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The summed per-token loss of `N` response positions, with their log-probs and terms (detached).

    `head` must be a plain, frozen nn.Linear (the LoRA student's LM head: tied embeddings are not trained);
    gradient flows into `hidden` only. `chunk_tokens` <= 0 takes all N positions in one chunk.
    Shapes: hidden [N, H], ids [N] -> (scalar fp32 loss, logprobs [N] fp32, terms [N] or None).
    """
    check_fusable(head)
    chunk = hidden.shape[0] if chunk_tokens <= 0 else chunk_tokens
    chunk = max(chunk, 1)
    ids = ids.to(hidden.device)
    total, logprobs, terms = _FusedHeadLoss.apply(hidden, head.weight, head.bias, ids, chunk, term_fn, loss_fn)
    return total, logprobs, (None if term_fn is None else terms)


@torch.no_grad()
def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Sampled-token log-probs of N positions, one chunk of logits at a time, no gradient (reference
    policy, probes, the teacher). Shapes: hidden [N, H], ids [N] -> [N] float32."""
    chunk = max(hidden.shape[0] if chunk_tokens <= 0 else chunk_tokens, 1)
    ids = ids.to(hidden.device)
    out = [chunk_logprobs(head(hidden[s : s + chunk]), ids[s : s + chunk]) for s in range(0, hidden.shape[0], chunk)]
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def check_fusable(head: torch.nn.Module) -> None:
    """The fused path computes logits as hidden @ W.T + b with a frozen W: refuse any other head."""
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"the fused LM-head loss needs a plain nn.Linear head, got {type(head).__name__}; do not put a"
            " LoRA adapter on lm_head (model.lora.target_modules) or set trainer.logprob_chunk_tokens=0"
        )
    if head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad):
        raise ValueError(
            "the fused LM-head loss computes no gradient for the LM head, but its weights are trainable;"
            " keep lm_head frozen (the LoRA student trains only its adapter)"
        )
