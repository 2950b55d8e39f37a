"""The LM head fused with the loss: per-token losses from final hidden states, one chunk of logits at a time.

The learner needs, for every response token, the policy's log-prob of the sampled token and (for GKD) a
divergence against the teacher's support: both are functions of that position's [V] logits. At a 152k
vocabulary those logits, their fp32 upcast and their gradient are what fill a 16 GB card. Here they exist for
`chunk_tokens` positions at a time, forward *and* backward:

- forward, per chunk of positions: logits = head(hidden[chunk]) [c, V], the log-probs and objective terms the
  loss reads, and the gradient of the loss with respect to the chunk's logits, turned into the gradient with
  respect to the chunk's hidden states (dlogits @ W, [c, H]); then the chunk's logits are freed (how: below);
- backward: the stored [N, H] gradient, scaled by the incoming one.

This is possible because every objective's loss is a *sum of per-token contributions*, each depending only
on its own position's logits (GKD: term_t / N; PG-k1: -w_t A_t rho_t / N with w_t from that token's ratio),
so a chunk's gradient is complete once the loss's few per-position numbers are known. Nothing vocabulary-sized
lives between chunks. Liger-Kernel's fused linear losses use the same idea; this
is written for miniVERL's objectives and checked against the direct path (tests/models/test_fused_head.py).

Most losses need only a few numbers of each position's [V] logits: the sampled token's log-prob (PG-k1), and
for GKD over a teacher's top-K support the student's log-probs at those K ids and of the tail bucket outside
them. Their gradient with respect to the logits has a closed form (`_logits_grad`), so those losses skip
autograd over [c, V] tensors and run in two passes (`_closed_form`): the few numbers of every position first,
one autograd call for the whole micro-batch's loss over them, then each chunk's logits again, overwritten in
place with their gradient. The vocabulary-wide work is two Triton passes over the bf16 logits
(models/vocab_kernels.py), so a chunk holds nothing but its logits. Losses that read the whole distribution
(full-vocabulary GKD, a loss temperature other than 1) go through autograd on each chunk (`term_fn`).

Shapes: N response tokens (flattened over rows), H hidden, V vocabulary, K support ids, c = chunk_tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miniverl.models.vocab_kernels import row_logsumexp, scaled_softmax_

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


@torch.no_grad()
def sampled_logprobs(logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits) at `ids` in fp32, temperature 1, without gradient and without an fp32 copy of the
    logits (`lse`, their row logsumexp, when the caller has it already). Shapes: [c, V], [c], [c] -> [c] float32."""
    lse = row_logsumexp(logits) if lse is None else lse
    return logits.gather(1, ids[:, None]).squeeze(1).float() - lse


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
    """The few numbers a closed-form loss reads from one chunk's logits. With a support, `logits` is left with
    -inf at the support ids (the tail's logsumexp is taken over it; the full one is the tail's and the support's
    together, so neither loses precision when the other is tiny). Shapes: logits [c, V] (any float dtype,
    never copied to fp32), ids [c], support_ids [c, K] -> lse [c], logprobs [c], support log-probs [c, K] or
    None, tail log-prob [c] or None, tail logsumexp [c] or None, the sampled ids' logits [c], all fp32."""
    sampled = logits.gather(1, ids[:, None]).squeeze(1).float()  # [c]
    if support_ids is None:
        lse = row_logsumexp(logits)  # [c]
        return lse, sampled - lse, None, None, None, sampled
    support = logits.gather(1, support_ids).float()  # [c, K]
    logits.scatter_(1, support_ids, float("-inf"))
    lse_tail = row_logsumexp(logits)  # [c]: log of the mass outside the support, unnormalized
    lse = torch.logaddexp(lse_tail, torch.logsumexp(support, dim=-1))  # [c]
    return lse, sampled - lse, support - lse[:, None], lse_tail - lse, lse_tail, sampled


def _logits_grad(x, lse, ids, sampled_logit, g_logprobs, support_ids, support, tail, lse_tail, g_support, g_tail):
    """d loss / d logits of one chunk, written over the logits `x` (as `_support_stats` left them) in place,
    in x's dtype: each entry computed in fp32 and rounded once.

    With p = softmax(logits), q = softmax over the tail ids only and P = the tail's mass (q_j = p_j / P):
    d logprob / dz_j = [j = id] - p_j, d support_k / dz_j = [j = k] - p_j, d tail / dz_j = q_j [j not in K] - p_j.
    Summed with the upstream gradients and G = g_logprobs + sum_k g_support_k + g_tail: -G p_j + g_tail q_j on the
    tail (= q_j (g_tail - G P), so nothing overflows when P is tiny), g_support_k - G p_k on the support, plus
    g_logprobs at the sampled id. The vocabulary-wide pass is one `scaled_softmax_`; the K + 1 columns that
    differ are computed apart (from the sampled id's fp32 logit, `sampled_logit`) and written over it.
    Shapes: x [c, V], the rest [c] or [c, K] -> x.
    """
    g_logprobs = torch.zeros_like(lse) if g_logprobs is None else g_logprobs
    if support_ids is None:
        scaled_softmax_(x, lse, -g_logprobs)  # -g p
        sampled = (sampled_logit - lse).exp() * -g_logprobs + g_logprobs  # [c]: -g p_id + g
        return x.scatter_(1, ids[:, None], sampled[:, None].to(x.dtype))
    g_support = torch.zeros_like(support) if g_support is None else g_support
    g_tail = torch.zeros_like(tail) if g_tail is None else g_tail
    total = g_logprobs + g_support.sum(dim=-1) + g_tail  # G [c]
    coef = g_tail - total * tail.exp()  # [c]
    scaled_softmax_(x, lse_tail, coef)  # the tail; the support columns hold -inf, so exp gives 0 there
    on_support = support_ids == ids[:, None]  # [c, K]: where the sampled id is one of the support's
    values = g_support - total[:, None] * support.exp() + on_support * g_logprobs[:, None]  # [c, K]
    x.scatter_(1, support_ids, values.to(x.dtype))
    sampled_tail = (sampled_logit - lse_tail).exp() * coef + g_logprobs  # [c]: q_id (g_tail - G P) + g
    sampled = torch.where(on_support.any(dim=-1), (values * on_support).sum(dim=-1), sampled_tail)
    return x.scatter_(1, ids[:, None], sampled[:, None].to(x.dtype))


def _closed_form(hidden, weight, bias, ids, chunk_tokens, loss_fn, support: Support | None):
    """The loss, log-probs, terms and gradient with respect to the hidden states of N positions, in two passes
    over chunks of logits with one autograd call between them, over [N] and [N, K] tensors only:

    1. per chunk: logits, then the few numbers the loss reads (`_support_stats`), kept for every position;
    2. the objective's terms and loss of all N positions at once, and their gradient with respect to those numbers;
    3. per chunk: the logits again, overwritten with their gradient (`_logits_grad`), times the head's weight.

    The head runs three times per position instead of two, which costs far less than the Python and the small
    kernels of the objective run once per chunk: the first GPU profile of the Triton passes (2026-12-02,
    lab/results/learner-throughput.md) had 2.1 s of GPU time in a 4.7 s update, the rest per-chunk overhead.
    Shapes: hidden [N, H], ids [N] -> (scalar, [N], [N] or None, [N, H])."""
    n = hidden.shape[0]
    f32 = {"dtype": torch.float32, "device": hidden.device}
    lse, logprobs, sampled = (torch.empty(n, **f32) for _ in range(3))
    sup = tail = lse_tail = None
    if support is not None:
        sup, tail, lse_tail = torch.empty(n, support.ids.shape[1], **f32), torch.empty(n, **f32), torch.empty(n, **f32)
    chunks = [slice(s, min(s + chunk_tokens, n)) for s in range(0, n, chunk_tokens)]
    for at in chunks:
        logits = F.linear(hidden[at], weight, bias)  # [c, V], model dtype: the chunk's only vocabulary-sized tensor
        stats = _support_stats(logits, ids[at], None if support is None else support.ids[at])
        lse[at], logprobs[at], sampled[at] = stats[0], stats[1], stats[5]
        if support is not None:
            sup[at], tail[at], lse_tail[at] = stats[2], stats[3], stats[4]
    everything = slice(0, n)
    with torch.enable_grad():
        leaves = [t.requires_grad_() for t in (logprobs, sup, tail) if t is not None]
        term = None if support is None else support.terms(sup, tail, everything)
        loss = loss_fn(logprobs, term, everything).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    g_logprobs, g_support, g_tail = (*grads, None, None)[:3]
    grad_hidden = torch.empty_like(hidden)  # [N, H]
    for at in chunks:
        logits = F.linear(hidden[at], weight, bias)  # [c, V]: the same logits as in the first pass
        support_ids = None
        if support is not None:
            support_ids = support.ids[at]
            logits.scatter_(1, support_ids, float("-inf"))
        picked = [None if t is None else t[at] for t in (g_logprobs, sup, tail, lse_tail, g_support, g_tail)]
        g_lp, sup_at, tail_at, lse_tail_at, g_sup, g_tail_at = picked
        args = (lse[at], ids[at], sampled[at], g_lp, support_ids, sup_at, tail_at, lse_tail_at, g_sup, g_tail_at)
        dlogits = _logits_grad(logits, *args)  # [c, V], over the logits
        grad_hidden[at] = dlogits @ weight  # [c, H]
    detached = None if term is None else term.detach()
    return loss.detach(), logprobs.detach(), detached, grad_hidden


def _autograd_chunks(hidden, weight, bias, ids, chunk_tokens, term_fn, loss_fn):
    """The loss of terms that read whole distributions (full-vocabulary GKD, a loss temperature): autograd on
    each chunk's own small graph, its [c, V] buffers freed before the next chunk.
    Shapes: hidden [N, H], ids [N] -> (scalar, [N], [N], [N, H])."""
    grad_hidden = torch.empty_like(hidden)  # [N, H]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
    terms = torch.empty_like(logprobs)
    for start in range(0, hidden.shape[0], chunk_tokens):
        at = slice(start, min(start + chunk_tokens, hidden.shape[0]))
        with torch.enable_grad():
            h = hidden[at].detach().requires_grad_()  # [c, H]
            _, lp, term = _chunk_values(h, weight, bias, ids, at, term_fn)
            chunk_loss = loss_fn(lp, term, at).sum()
            (grad_hidden[at],) = torch.autograd.grad(chunk_loss, h)  # [c, H]: dlogits @ W, then freed
        total += chunk_loss.detach()
        logprobs[at], terms[at] = lp.detach(), term.detach()
    return total, logprobs, terms, grad_hidden


class _FusedHeadLoss(torch.autograd.Function):
    """Sum of per-token losses through the LM head; backward returns the gradient computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, chunk_tokens, term_fn, loss_fn, support):
        if term_fn is None:  # closed-form gradient: the loss reads few numbers of each position's logits
            total, logprobs, terms, grad_hidden = _closed_form(
                hidden, weight, bias, ids, chunk_tokens, loss_fn, support
            )
        else:
            total, logprobs, terms, grad_hidden = _autograd_chunks(
                hidden, weight, bias, ids, chunk_tokens, term_fn, loss_fn
            )
        ctx.save_for_backward(grad_hidden)
        terms = torch.empty(0, device=hidden.device) if terms is None else terms
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
    out = [sampled_logprobs(head(hidden[s : s + chunk]), ids[s : s + chunk]) for s in range(0, hidden.shape[0], chunk)]
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
