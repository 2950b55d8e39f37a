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

Most losses need only a few numbers of each position's [V] logits: the sampled token's log-prob (PG-k1), and
for GKD over a teacher's top-K support the student's log-probs at those K ids and of the tail bucket outside
them. Their gradient with respect to the logits has a closed form (`_logits_grad`), so those chunks skip
autograd over [c, V] tensors: one fp32 copy of the chunk's logits is reduced, then overwritten in place with
the gradient (about 8 passes over [c, V] instead of about 25; measured in docs/benchmarks/learner-throughput.md).
Losses that read the whole distribution (full-vocabulary GKD, a loss temperature other than 1) go through
autograd on the chunk (`term_fn`).

Shapes: N response tokens (flattened over rows), H hidden, V vocabulary, K support ids, c = chunk_tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (logits [1, c, V] in the model's dtype, positions) -> the objective's per-token term [1, c]
TermFn = Callable[[torch.Tensor, slice], torch.Tensor]
# (logprobs [c] fp32, terms [c] or None, positions) -> per-token loss contributions [c]; the loss is their sum
LossFn = Callable[[torch.Tensor, torch.Tensor | None, slice], torch.Tensor]


@dataclass(frozen=True)
class Support:
    """A loss that reads each position's logits only through the student's log-probs at K ids and of the tail
    bucket outside them (GKD against a teacher's top-K at temperature 1)."""

    ids: torch.Tensor  # [N, K] long, distinct within a row, K < V
    # (support log-probs [c, K] fp32, tail log-prob [c] fp32, positions) -> the objective's term [c]
    terms: Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]


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


def _support_stats(logits: torch.Tensor, ids: torch.Tensor, support_ids: torch.Tensor | None):
    """The few numbers a closed-form loss reads from one chunk's logits, and the fp32 buffer its gradient is
    written into. With a support, the buffer holds -inf at the support ids (the tail's logsumexp is taken over
    it). Shapes: logits [c, V], ids [c], support_ids [c, K] -> buffer [c, V] fp32, lse [c], logprobs [c],
    support log-probs [c, K] or None, tail log-prob [c] or None, tail logsumexp [c] or None."""
    x = logits.to(torch.float32, copy=True)  # [c, V]: the only vocabulary-sized fp32 tensor of the chunk
    lse = torch.logsumexp(x, dim=-1)  # [c]
    logprobs = x.gather(1, ids[:, None]).squeeze(1) - lse
    if support_ids is None:
        return x, lse, logprobs, None, None, None
    support = x.gather(1, support_ids) - lse[:, None]  # [c, K]
    x.scatter_(1, support_ids, float("-inf"))
    lse_tail = torch.logsumexp(x, dim=-1)  # [c]: log of the mass outside the support, unnormalized
    return x, lse, logprobs, support, lse_tail - lse, lse_tail


def _logits_grad(x, lse, ids, g_logprobs, support_ids, support, tail, lse_tail, g_support, g_tail) -> torch.Tensor:
    """d loss / d logits of one chunk, written over `x` (see `_support_stats`) in place.

    With p = softmax(logits), q = softmax over the tail ids only and P = the tail's mass (q_j = p_j / P):
    d logprob / dz_j = [j = id] - p_j, d support_k / dz_j = [j = k] - p_j, d tail / dz_j = q_j [j not in K] - p_j.
    Summed with the upstream gradients and G = g_logprobs + sum_k g_support_k + g_tail: -G p_j + g_tail q_j on the
    tail (= q_j (g_tail - G P), so nothing overflows when P is tiny), g_support_k - G p_k on the support, plus
    g_logprobs at the sampled id. Shapes: x [c, V], the rest [c] or [c, K] -> [c, V] fp32 (x itself).
    """
    g_logprobs = torch.zeros_like(lse) if g_logprobs is None else g_logprobs
    if support_ids is None:
        x.sub_(lse[:, None]).exp_().mul_(-g_logprobs[:, None])  # -g p
    else:
        g_support = torch.zeros_like(support) if g_support is None else g_support
        g_tail = torch.zeros_like(tail) if g_tail is None else g_tail
        total = g_logprobs + g_support.sum(dim=-1) + g_tail  # G [c]
        x.sub_(lse_tail[:, None]).exp_().mul_((g_tail - total * tail.exp())[:, None])  # support columns: exp(-inf) = 0
        x.scatter_(1, support_ids, g_support - total[:, None] * support.exp())
    return x.scatter_add_(1, ids[:, None], g_logprobs[:, None])


def _closed_form_chunk(hidden, weight, bias, ids, positions, loss_fn, support: Support | None):
    """One chunk's loss, log-probs, terms and gradient with respect to its hidden states, autograd only over
    [c] and [c, K] tensors. Shapes: hidden [c, H], ids [c] -> (scalar, [c], [c] or None, [c, H])."""
    support_ids = None if support is None else support.ids[positions]
    logits = F.linear(hidden, weight, bias)  # [c, V], model dtype
    x, lse, logprobs, sup, tail, lse_tail = _support_stats(logits, ids, support_ids)
    del logits
    with torch.enable_grad():
        leaves = [t.requires_grad_() for t in (logprobs, sup, tail) if t is not None]
        term = None if support is None else support.terms(sup, tail, positions)
        chunk_loss = loss_fn(logprobs, term, positions).sum()
        grads = torch.autograd.grad(chunk_loss, leaves, allow_unused=True)
    g_logprobs, g_support, g_tail = (*grads, None, None)[:3]
    dlogits = _logits_grad(x, lse, ids, g_logprobs, support_ids, sup, tail, lse_tail, g_support, g_tail)
    grad_hidden = dlogits.to(weight.dtype) @ weight  # [c, H]
    return chunk_loss.detach(), logprobs.detach(), None if term is None else term.detach(), grad_hidden


class _FusedHeadLoss(torch.autograd.Function):
    """Sum of per-token losses through the LM head; backward returns the gradient computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, chunk_tokens, term_fn, loss_fn, support):
        grad_hidden = torch.empty_like(hidden)  # [N, H]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
        terms = None if term_fn is None and support is None else torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], chunk_tokens):
            positions = slice(start, min(start + chunk_tokens, hidden.shape[0]))
            if term_fn is None:  # closed-form gradient: the loss reads few numbers of each position's logits
                chunk_loss, lp, term, grad_hidden[positions] = _closed_form_chunk(
                    hidden[positions], weight, bias, ids[positions], positions, loss_fn, support
                )
            else:
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
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None, None


def fused_head_loss(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    ids: torch.Tensor,
    chunk_tokens: int,
    term_fn: TermFn | None,
    loss_fn: LossFn,
    support: Support | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The summed per-token loss of `N` response positions, with their log-probs and terms (detached).

    The terms come from `term_fn` (any function of the logits: autograd per chunk), or from `support` (a
    function of the support and tail log-probs: closed-form gradient), or there are none (the loss reads only
    the log-probs: closed-form gradient); give at most one of the two.
    `head` must be a plain, frozen nn.Linear (the LoRA student's LM head: tied embeddings are not trained);
    gradient flows into `hidden` only. `chunk_tokens` <= 0 takes all N positions in one chunk.
    Shapes: hidden [N, H], ids [N] -> (scalar fp32 loss, logprobs [N] fp32, terms [N] or None).
    """
    check_fusable(head)
    if term_fn is not None and support is not None:
        raise ValueError("give the loss's terms as a function of the logits or of a support, not both")
    chunk = hidden.shape[0] if chunk_tokens <= 0 else chunk_tokens
    chunk = max(chunk, 1)
    ids = ids.to(hidden.device)
    if support is not None:
        support = Support(support.ids.to(hidden.device, torch.long), support.terms)
    total, logprobs, terms = _FusedHeadLoss.apply(hidden, head.weight, head.bias, ids, chunk, term_fn, loss_fn, support)
    return total, logprobs, (None if term_fn is None and support is None else terms)


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
