"""Token sampling shared by every Hugging Face backend, so their outputs are comparable bit for bit.

Each row draws one uniform number per step from a counter-based hash of (its request seed, the step)
(`counter_uniforms`); the token is found by inverse-CDF over the processed distribution. The draw
therefore depends only on the row's seed, its step and its own logits, never on which other rows share
the batch, and needs no generator state: the whole sampling step runs on the device, inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miniverl.models.vocab_kernels import row_logsumexp, segment_logsumexp
from miniverl.rollout.decode_kernels import hash_uniforms, inverse_cdf


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


# The counter-based draw (counter_uniforms): a 32-bit integer hash ("lowbias32", C. Wellons' hash-prospector:
# xor-shift 16, multiply, xor-shift 15, multiply, xor-shift 16) absorbs the seed's two 32-bit halves and the step.
# Every value stays below 2**50 in int64, so the same integers come out on any device (no overflow, no float).
MASK32 = 0xFFFFFFFF
MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
STREAM_KEY = 0x9E3779B9  # 2**32 / golden ratio: keeps seed 0 at step 0 away from the hash's fixed point 0
UNIFORM_BITS = 24  # a float32 mantissa: every k / 2**24 is exact


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32), in pieces that never overflow int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MULTIPLIERS[1])
    return x ^ (x >> 16)


def counter_uniforms(seeds: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
    """One uniform draw in [0, 1) per row for sampling step `step`, a pure function of (row seed, step).

    No generator state: the draw of a row never depends on the other rows of the batch, on how many steps were
    drawn before, or on the device (integer arithmetic only), so it can run inside a CUDA graph, and samplers that
    batch rows differently (hf_reference, hf_cached) draw the same numbers. All 63 bits of a seed count (torch's CPU
    generator keeps only the low 32 of a manual seed).

    On CUDA the same integers come from one Triton kernel (rollout/decode_kernels.py `hash_uniforms`), not from
    about fifty small torch launches.

    Shapes: seeds [B] int64 (>= 0), step [] / [1] int64 tensor or int -> [B] float32, multiples of 2**-24.
    """
    fused = hash_uniforms(seeds, step, STREAM_KEY, MIX_MULTIPLIERS, UNIFORM_BITS)
    return _hashed_uniforms(seeds, step) if fused is None else fused


def _hashed_uniforms(seeds: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
    """counter_uniforms in torch ops (the CPU's path, and the kernel's reference in the tests)."""
    h = _mix32((seeds & MASK32) ^ STREAM_KEY)
    h = _mix32(h ^ (seeds >> 32))
    h = _mix32(h ^ (step & MASK32))
    return (h >> (32 - UNIFORM_BITS)).float() * 2.0**-UNIFORM_BITS


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
    logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, step: torch.Tensor | int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and return it with its raw (temperature-1, untruncated) log-prob.

    Inverse-CDF over the processed distribution with the row's counter-based draw for `step`; no host sync, no
    generator state, so it runs inside a captured CUDA graph as it runs eagerly. Without top-k/top-p the CDF is
    taken in two levels (`_two_level_inverse_cdf`), so the vocabulary is read once, not scanned.

    Shapes: logits [B, V], seeds [B] int64 on logits' device -> tokens [B] long, logprobs [B] float32.
    """
    lse = None  # log sum exp of the raw logits: the two-level CDF's total at temperature 1, else its own pass
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    elif params.top_k or params.top_p < 1.0:
        cdf = processed_logprobs(logits, params).exp_().cumsum_(dim=-1)  # [B, V]
        target = (counter_uniforms(seeds, step) * cdf[:, -1]).clamp(min=torch.finfo(torch.float32).tiny)
        tokens = torch.searchsorted(cdf, target.unsqueeze(-1)).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    else:
        scaled = logits if params.temperature == 1.0 else logits.float() / params.temperature
        tokens, total = _two_level_inverse_cdf(scaled, counter_uniforms(seeds, step))
        lse = total if params.temperature == 1.0 else None
    if lse is None:
        lse = row_logsumexp(logits)
    logprobs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float() - lse
    return tokens, logprobs


# Columns per first-level CDF entry: a [B, V / 4096] CDF over the segments' masses, then a scan of one segment.
SAMPLE_SEGMENT = 4096


def _two_level_inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token at cumulative mass u * total of softmax(x), found per row as: the segment of SAMPLE_SEGMENT
    columns holding it (a CDF of the segments' masses, models/vocab_kernels.py `segment_logsumexp`: one pass over
    x), then the column inside that segment (a scan of its columns only). A draw never lands on a column of
    probability 0: the target is capped at the segment's own last cumulative value.

    A vocabulary narrower than a segment is one segment of the next power of two (the built-in models' 43 tokens
    padded to 4,096 columns made each draw 9 ms on the CPU).

    Shapes: x [B, V], u [B] in [0, 1) -> tokens [B] long, log of the total mass [B] float32."""
    v = x.shape[1]
    width = min(SAMPLE_SEGMENT, 1 << max(0, v - 1).bit_length())
    seg = segment_logsumexp(x, width)  # [B, S]
    fused = inverse_cdf(x, seg, u, width)  # on CUDA: _segment_inverse_cdf's steps in one launch
    return _segment_inverse_cdf(x, seg, u, width) if fused is None else fused


def _segment_inverse_cdf(
    x: torch.Tensor, seg: torch.Tensor, u: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """_two_level_inverse_cdf after its segment sums, in torch ops (the CPU's path, and the kernel's reference in the
    tests). Shapes: x [B, V], seg [B, S] float32, u [B] -> tokens [B] long, log of the total mass [B] float32."""
    v = x.shape[1]
    total = torch.logsumexp(seg, dim=-1)  # [B]
    cdf = (seg - total[:, None]).exp_().cumsum_(dim=-1)  # [B, S]
    target = (u * cdf[:, -1]).clamp(min=torch.finfo(torch.float32).tiny)  # [B]
    s = torch.searchsorted(cdf, target.unsqueeze(-1)).squeeze(-1).clamp(max=seg.shape[1] - 1)  # [B]
    before = torch.where(s > 0, cdf.gather(-1, (s - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)  # [B]
    cols = s.unsqueeze(-1) * width + torch.arange(width, device=x.device)  # [B, SEG]
    inside = x.gather(-1, cols.clamp(max=v - 1)).float().masked_fill(cols >= v, float("-inf"))  # [B, SEG]
    inner = (inside - total[:, None]).exp_().cumsum_(dim=-1) + before[:, None]  # [B, SEG] absolute CDF
    aim = torch.minimum(target, inner[:, -1]).unsqueeze(-1)
    tokens = s * width + torch.searchsorted(inner, aim).squeeze(-1).clamp(max=width - 1)
    return tokens, total
