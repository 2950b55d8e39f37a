"""The served policy is the published one: strict sync proven by what a rollout replica computes, not by what
it was sent.

A digest of the adapter a replica was handed says nothing about the weights it samples with: hf_cached decodes
from adapter buffers of its own, vLLM from fused, padded, recast LoRA buffers, and no adapter digest sees the
base model (a bf16 base served against an NF4 learner differs by 1.66 nats per token: DESIGN.md). So a replica
that can digests its own serving buffers after every load (its served digest: miniverl/step/sync.py), and a probe
(a few fixed token sequences, the same for the whole run, and recent on-policy rows) goes through each replica's
serving path and through the learner: at the run's first refresh, every trainer.probe_every-th, and every
refresh of a replica without a served digest. Two separate tests: the gap test (the served log-probs match the
learner's within the replica's tolerance, twice it where the learner's log-prob is below TAIL_LOGPROB) and the
change test (when the learner's probe moved, the served one moved beyond the replica's own noise).
"""

from __future__ import annotations

import torch

from miniverl.errors import PolicyMismatchError

PROBE_SEQUENCES = 4
PROBE_TOKENS = 64  # per sequence: 4 x 63 = 252 compared log-probs, one short prefill on any engine
PROBE_SEED = 20_260_829  # fixed: the probe is a property of the run, never of a step

# Max |served - learner| log-prob (nats) over the probe, same weights, fp32 on the CPU (hf_reference and
# hf_cached against the learner's peft forward; the built-in student, a tiny trained and a tiny random
# model; three random adapters each): at most 8.6e-6 (lab/results/probe-tolerance-cpu.md). 1e-3
# leaves two orders of magnitude for other CPUs and BLAS builds and sits far below what one optimizer
# step moves the probe in the default run (median 0.71, min 0.28 nats over 40 steps), so a replica that
# missed a single refresh is caught.
FP32_PROBE_TOLERANCE = 1e-3
# bf16/fp16: vLLM bf16 against HF bf16 differs by mean 0.08 and p99 0.28 nats on sampled tokens
# (DESIGN.md, H200), and hf_cached bf16 against the bf16 learner by at most 0.25 over a probe (CPU, the
# built-in student; the same page). A probe takes the max over ~250 tokens, about the p99.6 of such a
# distribution, so its bound must sit well above 0.28: 0.75 leaves ~2.5x margin, and still refuses a
# base served in another precision or quantization (NF4 vs bf16: mean 1.66 nats, DESIGN.md). A bf16 step
# moves the probe far less than this (hundredths of a nat at lr 2e-5), so a stale bf16 replica is caught
# by the change test (check_changed), never by this bound. On a real model (SmolLM2-135M-Instruct) the honest bf16
# max over a probe is 0.45-0.54 nats on the CPU and reached 0.81-0.90 on the GPU, on positions the policy does not
# sample: TAIL_LOGPROB below holds those to twice this (lab/results/probe-tolerance-real.md).
HALF_PROBE_TOLERANCE = 0.75
# The tail: on a peaked real model in bf16 (SmolLM2-135M-Instruct, hf_cached against the learner, CPU) the honest
# gap is bf16 rounding of the base model, the same with or without an adapter (0.51 / 0.45 / 0.54 nats max for
# adapters moving the probe by 0 / 1.0 / 2.6 nats); its max sits on the fixed random-token positions, where the
# learner gives -16 to -23 nats (none of the 252 is above -5), and reached 0.81-0.90 on the GPU (issue 73), while
# on tokens above -5 nats (those the policy samples) it is at most 0.33. So positions below TAIL_LOGPROB are held to
# TAIL_FACTOR x the tolerance: 1.5 nats in bf16, still below a 4-bit base's gap there
# (lab/results/probe-tolerance-real.md).
TAIL_LOGPROB = -5.0
TAIL_FACTOR = 2.0


def probe_tolerance(dtype: torch.dtype) -> float:
    """The probe tolerance (nats) of an engine computing in `dtype`."""
    return HALF_PROBE_TOLERANCE if dtype in (torch.bfloat16, torch.float16) else FP32_PROBE_TOLERANCE


def draw_probe(vocab_size: int, max_positions: int, seed: int = PROBE_SEED) -> list[list[int]]:
    """PROBE_SEQUENCES sequences of token ids drawn uniformly from [0, vocab_size), deterministically.

    Any ids work: the probe compares two computations of the same function, not a model's quality.
    """
    if vocab_size < 2:
        raise ValueError(f"a probe needs a vocabulary of at least 2 tokens, got {vocab_size}")
    length = max(2, min(PROBE_TOKENS, max_positions))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (PROBE_SEQUENCES, length), generator=g).tolist()


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    """max |a - b| over two ragged lists of log-probs of the same shape."""
    if [len(r) for r in a] != [len(r) for r in b]:
        raise PolicyMismatchError(
            f"probe log-probs have row lengths {[len(r) for r in a]} and {[len(r) for r in b]}; an engine must"
            " return one log-prob per probe token after the first"
        )
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


def weighed_gap(served: list[list[float]], learner: list[list[float]]) -> tuple[float, float]:
    """The probe's max gap as the gap test weighs it, and the raw |served - learner| at that position (nats):
    a position where the learner's log-prob is below TAIL_LOGPROB counts 1/TAIL_FACTOR of its gap. Same shape
    check as max_gap; (0, 0) for an empty probe."""
    max_gap(served, learner)  # refuses rows of another shape
    return max(
        (
            (abs(x - y) / (1.0 if y >= TAIL_LOGPROB else TAIL_FACTOR), abs(x - y))
            for rs, rl in zip(served, learner)
            for x, y in zip(rs, rl)
        ),
        default=(0.0, 0.0),
    )


def check_gap(
    replica: int, version: int, served: list[list[float]], learner: list[list[float]], tolerance: float
) -> float:
    """The gap test: how far may this engine sit from the learner? Raise PolicyMismatchError when the
    served probe is more than `tolerance` nats from the learner's where the learner's log-prob is at least
    TAIL_LOGPROB, or more than TAIL_FACTOR x `tolerance` below it; return the weighed max gap (weighed_gap,
    nats, at most `tolerance` when it passes)."""
    gap, raw = weighed_gap(served, learner)
    if gap > tolerance:
        raise PolicyMismatchError(
            f"rollout replica {replica} serves probe log-probs up to {raw:.3g} nats away from the learner's"
            f" v{version} (its backend's tolerance is {tolerance:g}, {TAIL_FACTOR:g}x that on tokens the learner"
            f" gives less than {TAIL_LOGPROB:g} nats); it does not serve the published policy"
            " (stale or half-loaded weights, another base model or dtype), so the run stops before this step."
            " Check the replica's weight sync, and that rollout and learner load the same model and dtype"
        )
    return gap


# The learner must have moved the probe by more than this many times the replica's own noise before a
# served probe that stayed within that noise counts as stale. For a deterministic replica (every HF
# backend: same weights, same inputs, bit-identical log-probs) the noise is 0 and the test reads: the
# learner's probe changed in any bit, the served one in none.
CHANGE_MARGIN = 4.0


def check_changed(replica: int, version: int, served_moved: float, learner_moved: float, noise: float) -> None:
    """The change test: did the replica load what was published? Its noise floor is the replica's own
    determinism (`noise`: the max gap between two probes of the same weights, 0 when bit-identical).

    `served_moved` and `learner_moved` are max |now - previous refresh| over the probe sequences both
    refreshes scored (nats). A served probe that stayed within its noise while the learner's moved by
    more than CHANGE_MARGIN x that noise is stale, however small the learner's move: a bf16 step at lr
    2e-5 moves the probe by hundredths of a nat, far inside any gap tolerance.
    """
    if learner_moved > CHANGE_MARGIN * noise and served_moved <= noise:
        raise PolicyMismatchError(
            f"rollout replica {replica} serves the probe log-probs of the previous refresh (moved"
            f" {served_moved:.3g} nats, within its own noise of {noise:.3g}), although the learner's v{version}"
            f" moved them by {learner_moved:.3g} nats: the engine kept its old weights, so the run stops before"
            " this step. Check the replica's weight sync"
        )
