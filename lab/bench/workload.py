"""What every backend of a bench gets: the same random-init model on disk, adapter, prompts and seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lab.bench.config import AdapterSpec, BenchConfig
from miniverl.models.lora import LoraSettings
from miniverl.rollout.sampling import SamplingParams, row_seeds


@dataclass(frozen=True)
class Cell:
    """One measurement: a backend plan (by label), a generation length, G prompts x N samples."""

    label: str
    length: int
    prompts: int
    samples: int

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    @property
    def key(self) -> tuple[int, int, int]:
        """The workload, shared by every backend in the same cell position."""
        return (self.length, self.prompts, self.samples)


def expand_cells(cfg: BenchConfig) -> list[Cell]:
    """Backend-major, then length, then shape: the order they run in."""
    return [Cell(label, t, g, n) for label in cfg.backends for t in cfg.lengths for g, n in cfg.shapes]


def cell_requests(cfg: BenchConfig, cell: Cell) -> tuple[list[list[int]], SamplingParams, list[int]]:
    """Prompts (G lists of token ids), sampling params and one seed per row. No stop tokens: every row
    must produce exactly `cell.length` tokens, so tokens/s compares equal work."""
    w = cfg.workload
    rng = random.Random(w.seed * 1_000_003 + cell.prompts)  # same prompts for every length of a shape
    prompts = [
        [rng.randrange(cfg.model.vocab_size) for _ in range(rng.randint(w.prompt_min_len, w.prompt_max_len))]
        for _ in range(cell.prompts)
    ]
    params = SamplingParams(
        n=cell.samples,
        max_new_tokens=cell.length,
        temperature=w.temperature,
        top_k=w.top_k,
        top_p=w.top_p,
        stop_token_ids=(),
        seed=w.seed,
    )
    return prompts, params, row_seeds(w.seed, cell.rows)


def lora_settings(spec: AdapterSpec) -> LoraSettings:
    return LoraSettings(
        rank=spec.rank, alpha=spec.alpha, dropout=0.0, target_modules=tuple(spec.target_modules), init_seed=spec.seed
    )


def make_adapter(template: dict[str, torch.Tensor], spec: AdapterSpec) -> dict[str, torch.Tensor]:
    """A non-zero adapter with the served names and shapes (a fresh one has lora_B = 0 and tests nothing).
    Drawn in sorted-name order from one seeded generator, so every backend gets the same tensors."""
    g = torch.Generator().manual_seed(spec.seed)
    return {
        name: (torch.randn(t.shape, generator=g) * spec.init_std).to(t.dtype) for name, t in sorted(template.items())
    }
