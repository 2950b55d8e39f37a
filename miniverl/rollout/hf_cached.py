"""The fast Hugging Face sampler: one prefill per prompt, a static KV cache, a CUDA-graph decode step.

Same inputs, outputs and sampling code as hf_reference (the oracle), so the same weights and seeds give
the same tokens. What changes is the work per token:
- each prompt is prefilled once; its keys/values are copied into the cache rows of its n samples;
- keys/values live in buffers preallocated per layer ([rows, kv heads, columns, head dim]); prompts are
  right-aligned at column P (the longest prompt), so every row writes the same column each step;
- the base linear weights are fused (q/k/v and gate/up: one copy of those, 0.6 GB at the 0.5B shape) and
  the adapter is applied beside them, unmerged, with the learner's arithmetic (models/lora.py `lora_delta`:
  the LoRA term in the base's dtype; one A and one B matmul per fused group); a refresh writes only the
  adapter's buffers, in place;
- on CUDA, one decode step (all layers and the LM head) is captured as a CUDA graph per batch width and
  replayed: at rollout batch sizes, launching a thousand small kernels from Python, not the arithmetic,
  bounds an eager step;
- finished rows are compacted out of the cache so they stop costing work; with graphs the decode width
  drops to the next power of two, so at most log2(rows) graphs are captured.
The model's own embedding, rotary embedding, activation and LM head are used as they are. Supported:
Llama-style decoders (qwen2, llama) with plain LoRA adapters.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miniverl.errors import ConfigError, PolicyMismatchError
from miniverl.models.fused_head import head_logprobs
from miniverl.models.logprobs import token_logprobs
from miniverl.models.lora import LoraSettings, build_lora_model
from miniverl.policy import FlatCopy
from miniverl.rollout import Completion
from miniverl.rollout.hf_reference import left_pad
from miniverl.rollout.sampling import SamplingParams, make_generators, sample_next
from miniverl.step.served_policy import probe_tolerance
from miniverl.workers import CUDA_CAPTURE_LOCK

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
LORA_GROUPS = ("qkv_lora", "o_lora", "gate_up_lora", "down_lora")
CACHE_COLUMN_QUANTUM = 64
# The strict-sync probe's last tokens go through the decode step itself (the CUDA graphs generate replays):
# a stale or wrong graph, not only stale weights, shows in the probe. 8 steps cost 8 decode launches.
PROBE_CHUNK_TOKENS = 512  # prefill positions per LM-head chunk of a probe (as models/logprobs.py)
PROBE_DECODE_STEPS = 8  # cache length rounds up to this, so slightly longer prompts reuse buffers and graphs


@dataclass
class _Lora:
    """The LoRA of one fused projection group, applied unmerged with the learner's arithmetic
    (models/lora.py `lora_delta`): `out + (x A^T)(s B)^T` in the base's dtype, A and s B rounded to it. One A
    matmul and one B matmul serve the whole group: the A matrices are stacked, B is block-diagonal (projection
    j's s B in its own output rows and rank columns; the zeros add exact zeros), so a refresh writes only these
    buffers, in place. `a` and `b` keep the published weights as sent (fp32 masters); `a_cast` and `sb_cast`,
    what the decode reads, are rewritten from them at every load and every served digest (_Decoder._cast_adapter).
    """

    a: torch.Tensor  # [R, E]: the group's A matrices stacked over their ranks, as published
    b: torch.Tensor  # [O, R]: block-diagonal; rows of untargeted projections stay 0
    scale: torch.Tensor  # [O, 1]: lora_alpha / r of the projection owning each output row
    slots: list[tuple[str, str, slice, slice]]  # (A name, B name, its rank columns, its output rows)
    a_cast: torch.Tensor  # [R, E] in the base's dtype
    sb_cast: torch.Tensor  # [O, R] in the base's dtype: s B

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Shapes: x [..., E], out [..., O] (base projection incl. bias) -> [..., O] in out's dtype."""
        return out + F.linear(F.linear(x, self.a_cast), self.sb_cast)


def _lora_group(modules, names: dict[int, str], dtype: torch.dtype) -> _Lora | None:
    """Serving buffers for the LoRA of `modules` (fused in this order), or None when none is adapted.
    `names` maps a LoRA weight's data pointer to its name in the learner's adapter state dict; `dtype` is the
    base's, which the adapter's term is computed in."""
    outs = [getattr(m, "base_layer", m).weight.shape[0] for m in modules]
    adapted = []
    for m in modules:
        if not hasattr(m, "base_layer"):
            adapted.append(None)
            continue
        keys = [k for k in m.active_adapters if k in m.lora_A]
        if len(keys) != 1 or keys[0] in getattr(m, "lora_variant", {}) or getattr(m, "lora_bias", {}).get(keys[0]):
            raise ConfigError(
                "hf_cached serves one plain LoRA adapter per layer (no DoRA, no LoRA bias, no stacked adapters);"
                " use rollout=hf_reference"
            )
        adapted.append((m.lora_A[keys[0]].weight, m.lora_B[keys[0]].weight, float(m.scaling[keys[0]])))
    if not any(adapted):
        return None
    ref = next(w for w in adapted if w is not None)[0]
    ranks = [0 if w is None else w[0].shape[0] for w in adapted]
    a = torch.zeros(sum(ranks), ref.shape[1], dtype=ref.dtype, device=ref.device)
    b = torch.zeros(sum(outs), sum(ranks), dtype=ref.dtype, device=ref.device)
    scale = torch.zeros(sum(outs), 1, dtype=ref.dtype, device=ref.device)
    slots, r0, o0 = [], 0, 0
    for w, r, o in zip(adapted, ranks, outs):
        if w is not None:
            lora_a, lora_b, s = w
            rows, cols = slice(r0, r0 + r), slice(o0, o0 + o)
            a[rows] = lora_a.detach()
            b[cols, rows] = lora_b.detach()
            scale[cols] = s
            slots.append((names[lora_a.data_ptr()], names[lora_b.data_ptr()], rows, cols))
        r0, o0 = r0 + r, o0 + o
    return _Lora(a, b, scale, slots, torch.empty_like(a, dtype=dtype), torch.empty_like(b, dtype=dtype))


def _base(module) -> torch.Tensor:
    """The base weight of a (possibly peft-wrapped) linear layer. Shapes: -> [out, in]."""
    return getattr(module, "base_layer", module).weight.detach()


def _bias(module) -> torch.Tensor | None:
    layer = getattr(module, "base_layer", module)
    return None if layer.bias is None else layer.bias.detach()


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen2 define it: normalize in fp32, cast back, then scale. Shapes: [..., E] -> [..., E]."""
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ("rotate half" form). Shapes: x [B, T, heads, D], cos/sin [B, T, 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Decoder:
    """The decoder stack over serving weights, attending over caller-provided keys/values."""

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
        if hasattr(base.model.embed_tokens, "base_layer"):
            raise ConfigError("hf_cached does not serve LoRA on the embeddings; use rollout=hf_reference")
        self.layers = list(base.model.layers)
        self.embed = base.model.embed_tokens.weight
        self.lm_head = base.lm_head
        self.rotary = base.model.rotary_emb
        self.act = self.layers[0].mlp.act_fn
        self.final_norm = base.model.norm.weight
        self.eps = base.model.norm.variance_epsilon
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.scaling = self.layers[0].self_attn.scaling
        self.vocab_size = cfg.vocab_size
        from peft import get_peft_model_state_dict

        # Each LoRA weight's name in the adapter state dict the learner publishes, found by storage.
        names = {t.data_ptr(): k for k, t in get_peft_model_state_dict(peft_model).items()}
        self.weights = [self._serving_weights(layer, names) for layer in self.layers]
        self._cast_adapter()  # the serving copies of the adapter as built
        # The adapter as the decode step reads it: views of the serving buffers under the learner's names, made
        # once (a load copies into them; the served digest reads them). The buffers themselves never change
        # storage: CUDA graphs hold their addresses, so `served_digest` refuses buffers replaced since.
        self.views = self._adapter_views()
        self._storage = self._buffer_addresses()
        self._served: FlatCopy | None = None  # the served adapter packed for its digest (made at the first one)

    def _serving_weights(self, layer, names: dict[int, str]) -> dict[str, torch.Tensor | _Lora | None]:
        """The base weights fused per group (q/k/v, gate/up; o and down are the model's own tensors) and the
        adapter beside them, unmerged: a bf16 merge W + s B A rounds small updates away (at lr 1e-5, 90% of
        q_proj entries were unchanged after 7 updates), while the learner applies LoRA unmerged."""
        a, m = layer.self_attn, layer.mlp
        dtype = _base(a.q_proj).dtype
        qkv_bias = [_bias(p) for p in (a.q_proj, a.k_proj, a.v_proj)]
        up_bias = [_bias(p) for p in (m.gate_proj, m.up_proj)]
        return {
            "qkv": torch.cat([_base(p) for p in (a.q_proj, a.k_proj, a.v_proj)]),  # [(H + 2Hkv) D, E]
            "qkv_bias": None if qkv_bias[0] is None else torch.cat(qkv_bias),
            "qkv_lora": _lora_group((a.q_proj, a.k_proj, a.v_proj), names, dtype),
            "o": _base(a.o_proj),
            "o_bias": _bias(a.o_proj),
            "o_lora": _lora_group((a.o_proj,), names, dtype),
            "gate_up": torch.cat([_base(m.gate_proj), _base(m.up_proj)]),  # [2I, E]
            "gate_up_bias": None if up_bias[0] is None else torch.cat(up_bias),
            "gate_up_lora": _lora_group((m.gate_proj, m.up_proj), names, dtype),
            "down": _base(m.down_proj),
            "down_bias": _bias(m.down_proj),
            "down_lora": _lora_group((m.down_proj,), names, dtype),
            "norm1": layer.input_layernorm.weight,
            "norm2": layer.post_attention_layernorm.weight,
        }

    def _loras(self) -> list[_Lora]:
        return [w[k] for w in self.weights for k in LORA_GROUPS if w[k] is not None]

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Write a new adapter into the serving buffers in place (CUDA graphs keep reading the same memory):
        adapter-sized copies only (one multi-tensor copy call), no merge, nothing read back from the device."""
        if set(weights) != set(self.views):
            missing, extra = sorted(set(self.views) - set(weights))[:3], sorted(set(weights) - set(self.views))[:3]
            raise ValueError(
                f"adapter names do not match the served model (missing {missing}, unexpected {extra});"
                " learner and rollout must use the same model.lora settings"
            )
        torch._foreach_copy_(list(self.views.values()), [weights[name] for name in self.views], non_blocking=True)
        self._cast_adapter()

    def _cast_adapter(self) -> None:
        """Rewrite what the decode step reads (A and s B in the serving dtype) from the published buffers, for
        every group at once (models/lora.py `lora_delta`: the same rounding as the learner's)."""
        loras = self._loras()
        torch._foreach_copy_([lora.a_cast for lora in loras], [lora.a for lora in loras])
        scaled = torch._foreach_mul([lora.b for lora in loras], [lora.scale for lora in loras])
        torch._foreach_copy_([lora.sb_cast for lora in loras], scaled)

    def adapter(self) -> dict[str, torch.Tensor]:
        """The served adapter under the learner's names (CPU copies; benchmarks and tests read it)."""
        return {name: view.to("cpu", copy=True) for name, view in self.views.items()}

    def served_digest(self) -> str:
        """miniverl.policy.weights_digest of the adapter the decode step reads, from the serving buffers
        themselves (packed into one flat buffer of adapter size on their device, allocated at the first call).
        The decode reads bf16 copies of A and s B: they are rewritten from the digested buffers first, so what is
        served derives from exactly the bytes digested (and from s = lora_alpha / r, fixed at build and checked
        by the probe at the run's first refresh and under the gate's trial adapter). Refuses buffers whose storage
        changed since they were built: a CUDA graph captured before would still read the old memory, so their
        digest would not say what is served."""
        if self._buffer_addresses() != self._storage:
            raise PolicyMismatchError(
                "hf_cached's adapter buffers were replaced after the decoder was built; CUDA graphs captured"
                " before still read the old ones, so what the replica serves cannot be proven and the run stops."
                " A load must copy into the buffers in place (_Decoder.load)"
            )
        self._cast_adapter()
        if self._served is None:
            self._served = FlatCopy(self.views)
        return self._served.digest()

    def _adapter_views(self) -> dict[str, torch.Tensor]:
        """Each LoRA weight as a view of the buffer the decode step reads. Shapes: A [r, in], B [out, r]."""
        views = {}
        for lora in self._loras():
            for a_name, b_name, rows, cols in lora.slots:
                views[a_name] = lora.a[rows]
                views[b_name] = lora.b[cols, rows]
        return views

    def _buffer_addresses(self) -> list[int]:
        return [t.data_ptr() for lora in self._loras() for t in (lora.a, lora.b, lora.a_cast, lora.sb_cast)]

    @staticmethod
    def _project(x: torch.Tensor, w: dict, group: str) -> torch.Tensor:
        """One (fused) projection: the base weight, then the unmerged adapter. Shapes: [..., E] -> [..., O]."""
        out = F.linear(x, w[group], w[f"{group}_bias"])
        lora = w[f"{group}_lora"]
        return out if lora is None else lora.apply(x, out)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor, kv_for) -> torch.Tensor:
        """Final-norm hidden states. `kv_for(layer, k, v)` stores this step's keys/values and returns those to
        attend over; `bias` is 0 where a query may see a key and -inf elsewhere.

        Shapes: ids, positions [B, T]; bias [B, 1, T, L] float32 -> [B, T, E].
        """
        b, t = ids.shape
        nq, nkv, d = self.heads, self.kv_heads, self.head_dim
        h = F.embedding(ids, self.embed)  # [B, T, E]
        cos, sin = self.rotary(h, positions)  # [B, T, D] each
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        for i, w in enumerate(self.weights):
            qkv = self._project(_rms_norm(h, w["norm1"], self.eps), w, "qkv").view(b, t, nq + 2 * nkv, d)
            qk = _rotate(qkv[:, :, : nq + nkv], cos, sin)  # [B, T, H + Hkv, D]
            keys, values = kv_for(i, qk[:, :, nq:].transpose(1, 2), qkv[:, :, nq + nkv :].transpose(1, 2))
            attn = self._attend(qk[:, :, :nq].transpose(1, 2), keys, values, bias)  # [B, T, H * D]
            h = h + self._project(attn, w, "o")
            gate, up = self._project(_rms_norm(h, w["norm2"], self.eps), w, "gate_up").chunk(2, dim=-1)
            h = h + self._project(self.act(gate) * up, w, "down")
        return _rms_norm(h, self.final_norm, self.eps)

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
        self.decoder = _Decoder(self.model)
        self.probe_tolerance = probe_tolerance(dtype)
        # Graphs only where CUDA is; the CPU path is the plain eager loop. Graphs rather than torch.compile:
        # compiling a 24-layer step takes minutes per batch width, more than a rollout takes. Graph vs eager
        # on CUDA is what conf/bench/rollout-hf-cached-variants.yaml measures (not yet run).
        self.cuda_graphs = device.startswith("cuda")
        self._cache: _Cache | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        """Only the adapter moves: into the serving buffers the decode step reads (the peft module's own
        LoRA weights are not used for serving and stay as built)."""
        self.decoder.load(weights)

    def served_digest(self) -> str:
        """The digest of the serving buffers the prefill and every decode step (and CUDA graph) read."""
        return self.decoder.served_digest()

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return self.decoder.adapter()

    @torch.no_grad()
    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced through the path that samples: the serving weights and adapter buffers (never the
        peft module), the prefill over all but each sequence's last PROBE_DECODE_STEPS + 1 tokens, then up
        to PROBE_DECODE_STEPS decode steps over the KV cache (the CUDA graphs generate replays on a GPU).
        Shapes: one log-prob per token after the first of each sequence."""
        vocab = self.decoder.vocab_size
        if any(len(s) < 2 for s in sequences) or any(min(s) < 0 or max(s) >= vocab for s in sequences):
            raise ValueError(f"probe sequences need >= 2 token ids, each in [0, {vocab})")
        rows = len(sequences)
        # The prefill's last position scores the first of the last `tail` tokens (as it picks generate's first
        # token); the decode steps score the rest. A prefix of >= 1 token stays for the prefill.
        tail = min(PROBE_DECODE_STEPS + 1, min(len(s) for s in sequences) - 1)
        heads = [s[: len(s) - tail] for s in sequences]
        lens = [len(h) for h in heads]
        width_p = max(lens)
        cache = self._reserve(rows, width_p + tail)
        h = self._prefill_hidden(heads, 1, cache)  # [R, P, E], left-padded
        # Every prefill position at once (row-major; the last of each predicts the first tail token), the LM
        # head a chunk at a time, one copy to the host at the end (a .tolist() per row waits for the GPU each time).
        rows_p = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]).to(self.device)
        cols_p = torch.cat([torch.arange(width_p - n, width_p) for n in lens]).to(self.device)
        targets = torch.tensor([t for s, n in zip(sequences, lens) for t in s[1 : n + 1]], device=self.device)
        prefill = head_logprobs(h[rows_p, cols_p], self.decoder.lm_head, targets, PROBE_CHUNK_TOKENS)  # [sum lens]
        decoded = []  # [R] per decode step
        if tail > 1:
            cache.first_column[:rows] = width_p - torch.tensor(lens, device=self.device)
            cache.positions[:rows] = torch.tensor(lens, device=self.device) - 1
            cache.column.fill_(width_p - 1)
        for step in range(tail - 1):  # feed the token after the prefix (and those after it), score the next
            fed = [s[n + step] for s, n in zip(sequences, lens)]
            cache.tokens[:rows] = torch.tensor(fed, device=self.device)
            cache.positions.add_(1)
            cache.column.add_(1)
            logits = self._decode(self._width(rows, rows))[:rows]  # [R, V]
            ids = torch.tensor([s[n + step + 1] for s, n in zip(sequences, lens)], device=self.device)
            decoded.append(token_logprobs(logits[:, None], ids[:, None])[:, 0])
        flat = prefill.tolist()
        steps = torch.stack(decoded, dim=1).tolist() if decoded else [[] for _ in lens]  # [R, tail - 1]
        out, start = [], 0
        for n, tail_lp in zip(lens, steps):
            out.append(flat[start : start + n] + tail_lp)
            start += n
        return out

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
        vocab = self.decoder.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")

    def _reserve(self, rows: int, columns: int) -> _Cache:
        """The cache, grown (never shrunk) to fit; growing drops the graphs that hold the old buffers."""
        c = self._cache
        if c is not None and c.rows >= rows and c.columns >= columns:
            for buf in (*c.keys, *c.values):  # masked stale columns are still read as 0 * value: keep them finite
                buf.zero_()
            return c
        rows = max(rows, c.rows if c else 0)
        columns = -(-max(columns, c.columns if c else 0) // CACHE_COLUMN_QUANTUM) * CACHE_COLUMN_QUANTUM
        self._cache, self._graphs = None, {}
        d, dev = self.decoder, self.device
        shape = (rows, d.kv_heads, columns, d.head_dim)
        long = dict(dtype=torch.long, device=dev)
        self._cache = _Cache(
            keys=[torch.zeros(shape, dtype=d.embed.dtype, device=dev) for _ in d.layers],
            values=[torch.zeros(shape, dtype=d.embed.dtype, device=dev) for _ in d.layers],
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
        h = self._prefill_hidden(prompts, n, cache)  # [G, P, E]
        return self.decoder.lm_head(h[:, -1]).repeat_interleave(n, dim=0)  # [G*N, V]

    def _prefill_hidden(self, prompts: list[list[int]], n: int, cache: _Cache) -> torch.Tensor:
        """The prefill pass: left-padded prompts, keys/values copied into the cache rows of their n samples.

        Shapes: -> [G, P, E] final-norm hidden states, prompts right-aligned at column P.
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

        return self.decoder.hidden(ids, positions, bias, store)  # [G, P, E]

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
        h = self.decoder.hidden(ids, c.positions[:width, None], bias[:, None, None, :], write)  # [W, 1, E]
        return self.decoder.lm_head(h[:, -1])

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
        # thread_local: another thread's CUDA calls (a profiler, a memory poll, a colocated learner) must not break
        # the capture; the lock keeps that learner's cache release out of it (miniverl/workers/__init__.py).
        with CUDA_CAPTURE_LOCK, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._decode_step(width)
        return graph, logits

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
