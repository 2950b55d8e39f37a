"""Every sampling seed of a run from one scheme: (rollout.seed, purpose, step) -> one integer, no collisions.

    seed = PURPOSES.index(purpose) * PURPOSE_STRIDE + rollout.seed * STEP_STRIDE + step

with 0 <= step < STEP_STRIDE and 0 <= rollout.seed < MAX_BASE_SEED (config validation checks both), so
two different (rollout.seed, purpose, step) never share a seed, and a row's seed inside a call
(rollout/sampling.py: seed * 1_000_003 + row) never meets another call's. Training steps keep the
formula they always had (purpose 0: rollout.seed * 100_003 + step). Before this scheme the evaluation's
temperature-1 sample used rollout.seed + 17 (step 17's seeds) and the conformance gate 7919 (step 7919's).

Purposes (append only: an index is part of every seed drawn with it):
- train: step s samples its rollouts with (train, s), so a resumed run redraws the same tokens;
- eval:  every evaluation samples with (eval, 0): the same draws at every evaluation, so its curve
         compares policies, not noise;
- gate:  the conformance gate's sample, (gate, 0).
"""

from __future__ import annotations

PURPOSES = ("train", "eval", "gate")
STEP_STRIDE = 100_003  # a prime above any run's step count
PURPOSE_STRIDE = 2**40  # above every train/eval/gate seed of one purpose
MAX_BASE_SEED = PURPOSE_STRIDE // STEP_STRIDE  # 10,995,007 rollout seeds


def sampling_seed(base: int, purpose: str, step: int) -> int:
    """The sampling seed of `purpose` at `step` for rollout.seed `base`."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown seed purpose {purpose!r}; known: {', '.join(PURPOSES)}")
    if not 0 <= base < MAX_BASE_SEED:
        raise ValueError(f"rollout.seed={base}: must be in [0, {MAX_BASE_SEED})")
    if not 0 <= step < STEP_STRIDE:
        raise ValueError(f"step {step}: seeds are unique for steps in [0, {STEP_STRIDE}); lower trainer.total_steps")
    return PURPOSES.index(purpose) * PURPOSE_STRIDE + base * STEP_STRIDE + step
