"""Per-token KL estimators between the policy and a reference, with verl's names and clamps."""

from __future__ import annotations

import torch

from miniverl.objectives.aggregation import require_same_shape

# verl core_algos.kl_penalty("low_var_kl"): the log-ratio is clamped before exp and the estimate after,
# so one extreme token cannot blow up the penalty (Schulman's k3, "Approximating KL Divergence").
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0

_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
KL_KINDS = tuple(_ALIASES)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference on tokens sampled from the policy.

    kind: k1 (alias kl) `lp - ref`; k2 (mse) `0.5 (lp - ref)^2`; k3 (low_var_kl)
    `e^x - x - 1` with `x = clamp(ref - lp, -20, 20)`, result clamped to [-10, 10]; abs `|lp - ref|`.
    Inputs are natural-log probabilities of the sampled tokens. k1 and k3 are unbiased estimates of
    KL(policy || ref) under policy samples (k3 only before its clamps); k2 is biased but low-variance.

    Shapes: logprob, ref_logprob [B, T] -> [B, T].
    """
    if kind not in _ALIASES:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_KINDS)}")
    require_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    kind = _ALIASES[kind]
    diff = logprob - ref_logprob
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    x = torch.clamp(ref_logprob - logprob, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(x) - x - 1, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)
