"""Strict sync by probe: prove what a rollout replica serves by what it computes, not by what it was sent.

A digest of the adapter a replica was handed says nothing about the weights it samples with: hf_cached
decodes from merged copies of them, vLLM from fused, padded, recast LoRA buffers, and no adapter digest
sees the base model (a bf16 base served against an NF4 learner differs by 1.66 nats per token:
DESIGN.md). So after every refresh a fixed probe (a few token sequences, the same for the whole run)
goes through each replica's serving path and through the learner. The served log-probs must match the
learner's within the replica's tolerance, and must move when the learner's moved by more than it.
"""

from __future__ import annotations

import torch

from miniverl.protocol import PolicyMismatchError

PROBE_SEQUENCES = 4
PROBE_TOKENS = 64  # per sequence: 4 x 63 = 252 compared log-probs, one short prefill on any engine
PROBE_SEED = 20_260_829  # fixed: the probe is a property of the run, never of a step

# Max |served - learner| log-prob (nats) over the probe, same weights, fp32 on the CPU (hf_reference and
# hf_cached against the learner's peft forward; the built-in student, a tiny trained and a tiny random
# model; three random adapters each): at most 8.6e-6 (docs/benchmarks/probe-tolerance-cpu.md). 1e-3
# leaves two orders of magnitude for other CPUs and BLAS builds and sits far below what one optimizer
# step moves the probe in the default run (median 0.71, min 0.28 nats over 40 steps), so a replica that
# missed a single refresh is caught.
FP32_PROBE_TOLERANCE = 1e-3
# bf16/fp16: vLLM bf16 against HF bf16 differs by mean 0.08 and p99 0.28 nats on sampled tokens
# (DESIGN.md, H200), and hf_cached bf16 against the bf16 learner by at most 0.25 over a probe (CPU, the
# built-in student; the same page). A probe takes the max over ~250 tokens, about the p99.6 of such a
# distribution, so its bound must sit well above 0.28: 0.75 leaves ~2.5x margin, and still refuses a
# base served in another precision or quantization (NF4 vs bf16: mean 1.66 nats, DESIGN.md). A stale
# bf16 replica is caught once the learner has moved the probe by 0.75 (the default run's steps move it
# by 0.28 to 2.5 nats each in fp32).
HALF_PROBE_TOLERANCE = 0.75


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


def check_served(
    replica: int,
    version: int,
    served: list[list[float]],
    learner: list[list[float]],
    tolerance: float,
    previous: tuple[list[list[float]], list[list[float]]] | None = None,
) -> dict[str, float]:
    """Raise PolicyMismatchError unless `served` proves replica `replica` serves the learner's `version`.

    `previous` is (served, learner) probe log-probs of the last refresh that passed (None at the first).
    Returns the probe's max gap to the learner and how far the learner's own probe moved (nats).
    """
    gap = max_gap(served, learner)
    if gap > tolerance:
        raise PolicyMismatchError(
            f"rollout replica {replica} serves probe log-probs up to {gap:.3g} nats away from the learner's"
            f" v{version} (its backend's tolerance is {tolerance:g}); it does not serve the published policy"
            " (stale or half-loaded weights, another base model or dtype), so the run stops before this step."
            " Check the replica's weight sync, and that rollout and learner load the same model and dtype"
        )
    moved = 0.0
    if previous is not None:
        moved = max_gap(learner, previous[1])
        if moved > tolerance and max_gap(served, previous[0]) == 0.0:
            raise PolicyMismatchError(
                f"rollout replica {replica} serves exactly the probe log-probs of the previous refresh, although"
                f" the learner's v{version} moved them by {moved:.3g} nats (its tolerance is {tolerance:g}): the"
                " engine kept its old weights, so the run stops before this step. Check the replica's weight sync"
            )
    return {"gap": gap, "moved": moved}
