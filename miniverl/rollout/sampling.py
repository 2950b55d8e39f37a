"""Token sampling shared by every Hugging Face backend, so their outputs are comparable bit for bit.

Each row owns a `torch.Generator` seeded from its request seed and draws one uniform number per step;
the token is found by inverse-CDF over the processed distribution. The draw therefore depends only
on the row's seed, its step and its own logits, never on which other rows share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation."""

    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got {self.n} and {self.max_new_tokens}")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1; got {self.temperature}, {self.top_k}, {self.top_p}"
            )

    @classmethod
    def from_config(cls, cfg, stop_token_ids: tuple[int, ...]) -> SamplingParams:
        """The training steps' sampling settings from the rollout config (seed 0: each step sets its own)."""
        return cls(cfg.n, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def row_seeds(seed: int, num_rows: int, first_row: int = 0) -> list[int]:
    """One request seed per row (prompt-major, sample-minor), derived from the call's seed and the row's
    index in the whole step, so splitting a step over several replicas samples the same tokens."""
    return [(seed * 1_000_003 + i) % (2**63 - 1) for i in range(first_row, first_row + num_rows)]


def make_generators(seeds: list[int]) -> list[torch.Generator]:
    gens = []
    for s in seeds:
        g = torch.Generator(device="cpu")
        g.manual_seed(s)
        gens.append(g)
    return gens


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log of the distribution actually sampled: temperature, then top-k, then top-p.

    Shapes: logits [B, V] -> [B, V] float32 (-inf on removed tokens).
    """
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [B, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.log_softmax(x, dim=-1)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and return it with its raw (temperature-1, untruncated) log-prob.

    Shapes: logits [B, V], one generator per row -> tokens [B] long, logprobs [B] float32.
    """
    raw = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    if params.greedy:
        tokens = raw.argmax(dim=-1)
    else:
        probs = processed_logprobs(logits, params).exp()  # [B, V]
        u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(probs.device)  # [B]
        cdf = probs.cumsum(dim=-1)
        # u = 0 must not land on a leading zero-probability token: aim strictly above 0.
        target = (u * cdf[:, -1]).clamp(min=torch.finfo(torch.float32).tiny)  # [B]
        tokens = torch.searchsorted(cdf, target.unsqueeze(-1)).squeeze(-1)
        tokens = tokens.clamp(max=probs.shape[-1] - 1)
    return tokens, raw.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
