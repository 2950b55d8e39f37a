"""What every backend of a bench gets: the same random-init model on disk, adapter, prompts and seeds."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from miniverl.bench.config import AdapterSpec, BenchConfig, ModelShape
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


# Real architectures without downloads (DESIGN.md, "Models without downloads"): Qwen2.5 0.5B and 1.5B (two KV
# heads, the 151,936-token vocabulary, tied embeddings) and 7B (four KV heads, 152,064 logits, an untied head: the
# teacher's vocabulary padded past the student's, as the real pair); scripts/make_random_model.py and the benches.
QWEN_VOCAB = 151936
REAL_SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, intermediate_size=8960),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        intermediate_size=18944,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def real_shape(name: str, max_positions: int, seed: int = 0) -> ModelShape:
    """The ModelShape of a REAL_SHAPES entry (random init from `seed`)."""
    small = dict(num_key_value_heads=2, vocab_size=QWEN_VOCAB, tie_word_embeddings=True)
    return ModelShape(**(small | REAL_SHAPES[name]), max_position_embeddings=max_positions, init_seed=seed)


def qwen2_config(shape: ModelShape):
    """The transformers Qwen2Config of `shape` (what build_random_model saves; the fit planner's tests plan from it)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
    )


def build_random_model(shape: ModelShape, dtype: torch.dtype, device: str, target: Path) -> Path:
    """Save a random-init Qwen2 decoder of `shape` to `target` (config.json + safetensors) and return it."""
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(shape)
    torch.manual_seed(shape.init_seed)
    with torch.device(device):  # initializing 0.5B parameters on the GPU takes seconds, not a minute
        model = Qwen2ForCausalLM(config)
    model.to(dtype).save_pretrained(str(target))
    del model
    return target
