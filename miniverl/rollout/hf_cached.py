"""The fast Hugging Face sampler: one prefill per prompt, a static KV cache, a CUDA-graph decode step.

Same inputs, outputs and sampling code as hf_reference (the oracle), so the same weights and seeds give
the same tokens. What changes is the work per token:
- each prompt is prefilled once; its keys/values are copied into the cache rows of its n samples;
- keys/values live in buffers preallocated per layer ([rows, kv heads, columns, head dim]); a prompt
  is right-aligned at column P (the longest prompt), so every row writes the same column each step;
- on CUDA, one decode step (all layers and the LM head) is captured as a CUDA graph per batch width
  and replayed. A 0.5B model with LoRA launches a few thousand small kernels per token: launching
  them from Python, not the arithmetic, bounds an eager step at rollout batch sizes;
- finished rows are compacted out of the cache so they stop costing work; on CUDA the decode width
  drops to the next power of two, so at most log2(rows) graphs are ever captured.

The model is walked layer by layer through its own Hugging Face modules (norms, MLP, rotary embedding,
the peft LoRA projections): only attention and the cache are ours, so everything else computes
exactly what the reference computes. Supported: Llama-style decoders (qwen2, llama).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from miniverl.models.lora import LoraSettings, adapter_state, build_lora_model, load_adapter_state
from miniverl.protocol import ConfigError
from miniverl.rollout import Completion
from miniverl.rollout.hf_reference import left_pad
from miniverl.rollout.sampling import SamplingParams, make_generators, sample_next

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
CACHE_COLUMN_QUANTUM = 64  # cache length rounds up to this, so prompts a few tokens longer reuse buffers and graphs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (the Llama/Qwen2 "rotate half" form). Shapes: x [B, H, T, D], cos/sin [B, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Walker:
    """Runs the decoder stack of a (peft-wrapped) Hugging Face model against caller-provided keys/values."""

    def __init__(self, peft_model) -> None:
        base = peft_model.get_base_model()
        cfg = base.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"rollout backend hf_cached supports {', '.join(SUPPORTED_MODEL_TYPES)} decoders, not"
                f" {cfg.model_type!r}; use rollout=hf_reference for this model"
            )
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ConfigError("hf_cached has no sliding-window attention; use rollout=hf_reference for this model")
        self.embed = base.model.embed_tokens
        self.layers = list(base.model.layers)
        self.norm = base.model.norm
        self.rotary = base.model.rotary_emb
        self.lm_head = base.lm_head
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.scaling = self.layers[0].self_attn.scaling
        self.vocab_size = cfg.vocab_size

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor, kv_for) -> torch.Tensor:
        """Final-norm hidden states. `kv_for(layer, k, v)` stores this step's keys/values and returns the
        keys/values to attend over; `bias` is 0 where a query may attend a key and -inf elsewhere.

        Shapes: ids, positions [B, T]; bias [B, 1, T, L] float32 -> [B, T, E].
        """
        b, t = ids.shape
        h = self.embed(ids)  # [B, T, E]
        cos, sin = self.rotary(h, positions)  # [B, T, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
            k = attn.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
            v = attn.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            keys, values = kv_for(i, _rotate(k, cos, sin), v)  # [B, Hkv, L, D] each
            h = h + attn.o_proj(self._attend(_rotate(q, cos, sin), keys, values, bias))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention without repeating keys: query head h reads kv head h // (H / Hkv).

        Shapes: q [B, H, T, D], keys/values [B, Hkv, L, D], bias [B, 1, T, L] -> [B, T, H * D].
        """
        b, _, t, d = q.shape
        g = self.heads // self.kv_heads
        q = q.reshape(b, self.kv_heads, g * t, d)  # [B, Hkv, g*T, D]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scaling  # [B, Hkv, g*T, L]
        scores = scores.view(b, self.kv_heads, g, t, -1) + bias.unsqueeze(1)  # [B, Hkv, g, T, L] float32
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(b, self.kv_heads, g * t, -1)
        out = torch.matmul(probs, values)  # [B, Hkv, g*T, D]
        return out.view(b, self.heads, t, d).transpose(1, 2).reshape(b, t, self.heads * d)


@dataclass
class _Cache:
    """Buffers preallocated for `rows` x `columns`; decode reads them in place (CUDA graphs hold their addresses)."""

    keys: list[torch.Tensor]  # per layer [R, Hkv, L, D]
    values: list[torch.Tensor]  # per layer [R, Hkv, L, D]
    tokens: torch.Tensor  # [R] long: the token each row feeds next
    positions: torch.Tensor  # [R] long: its position id
    first_column: torch.Tensor  # [R] long: first cache column holding a real prompt token
    column: torch.Tensor  # [1] long: the column this step writes
    arange: torch.Tensor  # [L] long

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def columns(self) -> int:
        return self.arange.shape[0]


class HFCachedBackend:
    def __init__(self, model_path: str, lora: LoraSettings, dtype: torch.dtype, device: str) -> None:
        self.device = device
        self.model = build_lora_model(model_path, lora, dtype, device).eval()
        self.walker = _Walker(self.model)
        # Graphs only where CUDA is: the CPU path is the plain eager loop. Measured choice: see
        # docs/benchmarks/rollout-runtime-v2.md (torch.compile's minutes of compilation per batch width
        # do not pay back on rollouts of seconds).
        self.cuda_graphs = device.startswith("cuda")
        self._cache: _Cache | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_weights: tuple[int, ...] = ()

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        load_adapter_state(self.model, weights)
        if self._weight_addresses() != self._graph_weights:  # a graph would read stale memory
            self._graphs.clear()

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.model)

    @property
    def decode_mode(self) -> str:
        return "cuda_graph" if self.cuda_graphs else "eager"

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        self._check(prompts, params, seeds)
        n, rows = params.n, len(prompts) * params.n
        lengths = [len(p) for p in prompts for _ in range(n)]
        width_p = max(lengths)
        cache = self._reserve(rows, width_p + params.max_new_tokens)
        gens = make_generators(seeds)
        done = [Completion([], [], False) for _ in range(rows)]
        stop = set(params.stop_token_ids)

        logits = self._prefill(prompts, n, cache)  # [R, V]
        lens = torch.tensor(lengths, device=self.device)
        cache.first_column[:rows] = width_p - lens
        cache.positions[:rows] = lens - 1  # bumped before each decode step: the first fed token sits at len(p)
        cache.column.fill_(width_p - 1)
        slots = list(range(rows))  # slot -> row; live rows occupy the first len(slots) cache slots
        for step in range(params.max_new_tokens):
            tokens, logprobs = sample_next(logits[: len(slots)], params, [gens[r] for r in slots])
            keep = []
            for j, (row, tok, lp) in enumerate(zip(slots, tokens.tolist(), logprobs.tolist())):
                done[row].token_ids.append(tok)
                done[row].logprobs.append(lp)
                done[row].finished = tok in stop
                if not done[row].finished:
                    keep.append(j)
            if not keep or step == params.max_new_tokens - 1:
                break
            if len(keep) < len(slots):  # finished rows leave the cache: they stop costing work
                self._compact(cache, keep, len(slots))
                tokens = tokens[torch.tensor(keep, device=tokens.device)]
                slots = [slots[j] for j in keep]
            cache.tokens[: len(slots)] = tokens
            cache.positions.add_(1)
            cache.column.add_(1)
            logits = self._decode(self._width(len(slots), rows))
        return done

    def _check(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> None:
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        if len(seeds) != len(prompts) * params.n:
            raise ValueError(f"need one seed per completion ({len(prompts) * params.n}), got {len(seeds)}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.walker.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.walker.vocab_size})")

    def _reserve(self, rows: int, columns: int) -> _Cache:
        """The cache, grown (never shrunk) to fit; growing drops the graphs that hold the old buffers."""
        c = self._cache
        if c is not None and c.rows >= rows and c.columns >= columns:
            for buf in (*c.keys, *c.values):  # stale columns would be read (masked) as 0 * value: keep them finite
                buf.zero_()
            return c
        rows = max(rows, c.rows if c else 0)
        columns = -(-max(columns, c.columns if c else 0) // CACHE_COLUMN_QUANTUM) * CACHE_COLUMN_QUANTUM
        self._cache, self._graphs = None, {}
        w, dev = self.walker, self.device
        dtype = w.embed.weight.dtype
        shape = (rows, w.kv_heads, columns, w.head_dim)
        long = dict(dtype=torch.long, device=dev)
        self._cache = _Cache(
            keys=[torch.zeros(shape, dtype=dtype, device=dev) for _ in w.layers],
            values=[torch.zeros(shape, dtype=dtype, device=dev) for _ in w.layers],
            tokens=torch.zeros(rows, **long),
            positions=torch.zeros(rows, **long),
            first_column=torch.zeros(rows, **long),
            column=torch.zeros(1, **long),
            arange=torch.arange(columns, **long),
        )
        return self._cache

    def _prefill(self, prompts: list[list[int]], n: int, cache: _Cache) -> torch.Tensor:
        """Run each prompt once, copy its keys/values into its n rows, return next-token logits per row.

        Shapes: -> [G * N, V].
        """
        ids, mask = left_pad(prompts)  # [G, P] each
        g, p = ids.shape
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
        # A padding query may see itself, so no softmax row is all -inf (NaN would reach real rows via 0 * NaN).
        allowed = (causal & mask.bool()[:, None, :]) | torch.eye(p, dtype=torch.bool, device=self.device)
        bias = torch.zeros(g, 1, p, p, device=self.device).masked_fill(~allowed[:, None], float("-inf"))

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cache.keys[layer][: g * n, :, :p] = k.repeat_interleave(n, dim=0)
            cache.values[layer][: g * n, :, :p] = v.repeat_interleave(n, dim=0)
            return k, v

        h = self.walker.hidden(ids, positions, bias, store)  # [G, P, E]
        return self.walker.lm_head(h[:, -1]).repeat_interleave(n, dim=0)  # [G*N, V]

    def _decode_step(self, width: int) -> torch.Tensor:
        """Feed cache.tokens[:width] at cache.column; the body a CUDA graph captures. Shapes: -> [width, V]."""
        c = self._cache
        visible = (c.arange >= c.first_column[:width, None]) & (c.arange <= c.column)  # [W, L]
        bias = torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = c.keys[layer][:width], c.values[layer][:width]
            keys.index_copy_(2, c.column, k)
            values.index_copy_(2, c.column, v)
            return keys, values

        ids = c.tokens[:width, None]  # [W, 1]
        h = self.walker.hidden(ids, c.positions[:width, None], bias[:, None, None, :], write)  # [W, 1, E]
        return self.walker.lm_head(h[:, -1])

    def _decode(self, width: int) -> torch.Tensor:
        if not self.cuda_graphs:
            return self._decode_step(width)
        if width not in self._graphs:
            try:
                self._graphs[width] = self._capture(width)
            except RuntimeError as e:  # keep serving, but say so: the speed claim no longer holds
                warnings.warn(f"hf_cached: CUDA graph capture failed ({e}); decoding eagerly", stacklevel=2)
                self.cuda_graphs = False
                return self._decode_step(width)
        graph, logits = self._graphs[width]
        graph.replay()
        return logits

    def _capture(self, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture one decode step. Warm-up runs first (lazy cuBLAS state); they rewrite the same column
        with the same values, so running the step again on replay is harmless."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_step(width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a benchmark thread polling memory must not break the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._decode_step(width)
        self._graph_weights = self._weight_addresses()
        return graph, logits

    def _weight_addresses(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _width(self, live: int, rows: int) -> int:
        """Rows a decode step computes: exactly the live rows eagerly; the next power of two with graphs."""
        if not self.cuda_graphs:
            return live
        return min(rows, 1 << (live - 1).bit_length())

    def _compact(self, cache: _Cache, keep: list[int], live: int) -> None:
        """Move the kept slots (indices into the first `live` slots) to the front, in order."""
        idx = torch.tensor(keep, device=self.device)
        m = len(keep)
        for buf in (*cache.keys, *cache.values, cache.positions, cache.first_column):
            buf[:m] = buf[:live].index_select(0, idx)
