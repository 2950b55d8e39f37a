"""verl parity: KL estimators (verl core_algos.kl_penalty_forward) and GRPO group normalization
(verl compute_grpo_outcome_advantage). Expected outputs are computed by hand from verl's definitions:

  k1 / kl        : lp - ref
  abs            : |lp - ref|
  k2 / mse       : 0.5 (lp - ref)^2
  k3 / low_var_kl: x = clamp(ref - lp, -20, 20); clamp(exp(x) - x - 1, -10, 10)
  grpo           : per uid, (s - mean) / (std + 1e-6), std unbiased (torch.std); a group of one uses
                   mean 0 and std 1; norm_adv_by_std_in_grpo=False only subtracts the mean.
"""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.objectives import grpo_advantages, kl_penalty
from miniverl.objectives.kl import KL_KINDS

E = math.e

# Sampled-token log-probs of the policy (lp) and the reference (ref), one case per column, x = ref - lp.
LP = torch.tensor([-1.0, -1.5, -0.5, -3.5, -2.0, -1.0, -12.0, -0.1, -30.0, float("-inf")], dtype=torch.float64)
REF = torch.tensor([-1.0, -0.5, -1.5, -1.0, -5.0, -11.0, -1.0, -25.1, -5.0, -1.0], dtype=torch.float64)
#                    x=0   x=1   x=-1  x=2.5 x=-3  x=-10 x=11  x=-25  x=25  x=+inf
K1 = [0.0, -1.0, 1.0, -2.5, 3.0, 10.0, -11.0, 25.0, -25.0, float("-inf")]  # lp - ref
K2 = [0.0, 0.5, 0.5, 3.125, 4.5, 50.0, 60.5, 312.5, 312.5, float("inf")]  # 0.5 (lp - ref)^2 (no clamp in verl)
K3 = [
    0.0,  # x = 0: e^0 - 0 - 1
    E - 2,  # x = 1: e - 1 - 1 = 0.71828...
    1 / E,  # x = -1: e^-1 + 1 - 1 = 0.36788...
    math.exp(2.5) - 3.5,  # x = 2.5: 8.68249..., just inside the +10 value clamp (which binds from x ~ 2.61)
    math.exp(-3) + 2,  # x = -3: 2.04979...
    math.exp(-10) + 9,  # x = -10: 9.0000454, just inside the value clamp on the negative-x side (x ~ -11)
    10.0,  # x = 11: e^11 - 12 = 59862 -> value clamp 10
    10.0,  # x = -25 -> log-ratio clamp -20: e^-20 + 19 = 19.000000002 -> value clamp 10
    10.0,  # x = 25 -> log-ratio clamp 20: e^20 - 21 -> value clamp 10
    10.0,  # lp = -inf: x = +inf -> clamp 20 -> 10. Without the log-ratio clamp this is inf - inf = nan.
]


@pytest.mark.parametrize(("kinds", "expected"), [(("k1", "kl"), K1), (("k2", "mse"), K2), (("k3", "low_var_kl"), K3)])
def test_kl_estimators_match_verl(kinds, expected):
    want = torch.tensor(expected, dtype=torch.float64)
    for kind in kinds:
        got = kl_penalty(LP, REF, kind)
        assert got.shape == LP.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_abs_estimator_matches_verl():
    torch.testing.assert_close(kl_penalty(LP, REF, "abs"), torch.tensor(K1, dtype=torch.float64).abs())


def test_k3_value_clamp_boundary():
    """exp(x) - x - 1 = 10 near x = 2.6; just below it the value passes, just above it is clamped to 10."""
    x_star = 2.5  # find the crossing by bisection on the closed form, then probe either side of it
    lo, hi = 2.5, 3.0
    for _ in range(60):
        x_star = (lo + hi) / 2
        lo, hi = (x_star, hi) if math.exp(x_star) - x_star - 1 < 10 else (lo, x_star)
    ref = torch.tensor([x_star - 1e-3, x_star + 1e-3], dtype=torch.float64)
    got = kl_penalty(torch.zeros(2, dtype=torch.float64), ref, "k3")
    assert got[0].item() == pytest.approx(math.exp(x_star - 1e-3) - (x_star - 1e-3) - 1, abs=1e-12)
    assert got[0].item() < 10.0
    assert got[1].item() == 10.0


def test_unknown_kl_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*low_var_kl"):
        kl_penalty(LP, REF, "k4")
    assert set(KL_KINDS) >= {"k1", "k2", "k3", "kl", "mse", "low_var_kl", "abs"}


def test_kl_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="shapes must match"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(3, 2), "k1")


# ---------------------------------------------------------------------------------------------------
# GRPO. Groups: a = [1, 0, 0], b = [1, 1], c = [0.7] (a group of one), d = [2, -1].
#   a: mean 1/3; unbiased std = sqrt(((2/3)^2 + 2 (1/3)^2) / (3 - 1)) = sqrt(1/3) = 0.57735
#      (the biased std sqrt(2/9) = 0.4714 would give different numbers, so this checks the choice)
#   b: mean 1, std 0 -> (1 - 1) / (0 + 1e-6) = 0
#   c: group of one -> mean 0, std 1 -> 0.7 / (1 + 1e-6)
#   d: mean 1/2; std = sqrt((1.5^2 + 1.5^2) / 1) = 1.5 sqrt 2 -> +-1.5 / (1.5 sqrt 2 + 1e-6)
UID = ["a", "a", "a", "b", "b", "c", "d", "d"]
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.7, 2.0, -1.0], dtype=torch.float64)
SA, SD = math.sqrt(1 / 3), 1.5 * math.sqrt(2)
GRPO = [
    (2 / 3) / (SA + 1e-6),
    (-1 / 3) / (SA + 1e-6),
    (-1 / 3) / (SA + 1e-6),
    0.0,
    0.0,
    0.7 / (1 + 1e-6),
    1.5 / (SD + 1e-6),
    -1.5 / (SD + 1e-6),
]
GRPO_MEAN_ONLY = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.7, 1.5, -1.5]


def test_grpo_matches_verl():
    got = grpo_advantages(SCORES, UID)
    torch.testing.assert_close(got, torch.tensor(GRPO, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert got[0].item() != pytest.approx((2 / 3) / math.sqrt(2 / 9), rel=1e-3)  # not the biased std


def test_grpo_without_std_normalization_only_centres():
    got = grpo_advantages(SCORES, UID, norm_by_std=False)
    torch.testing.assert_close(got, torch.tensor(GRPO_MEAN_ONLY, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_grpo_group_of_one_keeps_its_score():
    got = grpo_advantages(torch.tensor([3.0, -2.0]), ["x", "y"])
    torch.testing.assert_close(got, torch.tensor([3.0, -2.0]) / (1 + 1e-6))


def test_permuting_groups_permutes_advantages():
    """Group order (and interleaving rows of different groups) changes nothing but the row order."""
    perm = torch.tensor([6, 7, 5, 3, 0, 4, 2, 1])
    got = grpo_advantages(SCORES[perm], [UID[i] for i in perm])
    torch.testing.assert_close(got, grpo_advantages(SCORES, UID)[perm], rtol=0, atol=0)


def test_grpo_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="one uid per row"):
        grpo_advantages(torch.zeros(3), ["a", "b"])
    with pytest.raises(ValueError, match="one uid per row"):
        grpo_advantages(torch.zeros(2, 2), ["a", "b"])
