"""Rollout backends behind one small Protocol, chosen by name (`rollout.backend`) and imported lazily."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch

from miniverl.config.rollout import BACKENDS
from miniverl.errors import ConfigError
from miniverl.rollout.sampling import SamplingParams

# The backends' registry (names -> lazy "module:class" paths) lives in config/rollout.py, beside the check of
# rollout.backend, so that the config names them without importing this package.
__all__ = ["BACKENDS", "ENGINES", "Completion", "RolloutBackend", "require_engine"]


@dataclass
class Completion:
    """One sampled response: its token ids (ending with the stop token when it stopped) and their raw
    log-probs; `finished` is False when it ran out of max_new_tokens."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool


class RolloutBackend(Protocol):
    """A sampler that serves the student with a LoRA adapter the learner publishes.

    Strict sync trusts no echo of the weights it was sent (miniverl/step/sync.py): after every load the
    backend digests the adapter buffers its serving path reads (`served_digest`), where it has such buffers;
    and the controller compares `probe_logprobs` with the learner's on a probe (miniverl/served_policy.py)
    at the first refresh, periodically, and at every refresh of a backend without a served digest.
    """

    probe_tolerance: float  # max |served - learner| log-prob (nats) on probe tokens for this backend/dtype

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace the served adapter with `weights` (learner names; CPU tensors, or views of the learner's
        GPU buffer that must be copied out before this returns)."""

    def served_digest(self) -> str | None:
        """miniverl.policy.weights_digest of the adapter exactly as the serving path reads it (the engine's own
        buffers, under the learner's names, dtypes and shapes), or None when the engine keeps a copy that cannot
        be read back as the learner's bytes (vLLM's fused, padded LoRA buffers)."""

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The adapter's names and shapes as the engine holds them (benchmarks build adapters from it)."""

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t = 1..len-1 of each sequence, through the SERVING path, temp 1."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        """Sample params.n completions per prompt, prompt-major; `seeds` has one seed per completion."""


# The backends that run an inference engine of their own: CUDA only, each its package and how to install it.
ENGINES = {
    "vllm": (
        "vllm",
        "vLLM is not installed; pip install -e '.[vllm]' (vLLM 0.26.0, built for torch 2.11 + CUDA 13), or use"
        " rollout=hf_cached",
    ),
    "sglang": (
        "sglang",
        "SGLang is not installed; install sglang 0.5.17 (built for torch 2.11 + CUDA 13:"
        " lab/results/sglang-feasibility.md), or use rollout=hf_cached or rollout=vllm",
    ),
}


def require_engine(backend: str, device: str) -> None:
    """Fail before any actor starts when `backend`'s engine cannot run here, saying what to install or change; the
    HF backends need nothing."""
    if backend not in ENGINES:
        return
    if device != "cuda":
        raise ConfigError(
            f"rollout={backend} needs a CUDA GPU but this run computes on the CPU; use rollout=hf_cached"
            " (or hf_reference) on a machine without a GPU"
        )
    package, missing = ENGINES[backend]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"rollout={backend} but {missing}")
