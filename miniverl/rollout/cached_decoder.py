"""hf_cached's decoder: the student's layers over serving weights, with the adapter applied unmerged.

Per projection group (q/k/v, o, gate/up, down) the base linear weights are fused into one tensor with the
adapter's A stacked under them (the peft modules' own base weights become views of it, so nothing is held twice);
the rest of the adapter sits beside them in serving buffers that a refresh writes in place (CUDA graphs hold
their addresses), computed with the learner's arithmetic (models/lora.py `lora_delta`: the LoRA term in the base's
dtype; one A and one B matmul per fused group). The model's own
embedding, rotary embedding, activation and LM head are used as they are. Supported: Llama-style decoders
(qwen2, llama) with plain LoRA adapters. Attention reads keys/values the caller provides (rollout/decode_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miniverl.errors import ConfigError, PolicyMismatchError
from miniverl.models.lora import check_adapter_names
from miniverl.policy import FlatCopy
from miniverl.rollout import decode_kernels

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
LORA_GROUPS = ("qkv_lora", "o_lora", "gate_up_lora", "down_lora")


@dataclass
class LoraGroup:
    """The LoRA of one fused projection group, applied unmerged with the learner's arithmetic
    (models/lora.py `lora_delta`): `out + (x A^T)(s B)^T` in the base's dtype, A and s B rounded to it. One A
    matmul and one B matmul serve the whole group: the A matrices are stacked, B is block-diagonal (projection
    j's s B in its own output rows and rank columns; the zeros add exact zeros), so a refresh writes only these
    buffers, in place. The A matmul rides on the base's: A's serving copy is stacked under the base weight, so
    one GEMM gives the base output and x A^T (each output column a dot product of its own: the same numbers).
    `a` and `b` keep the published weights as sent (fp32 masters); `a_cast` and `sb_cast`,
    what the decode reads, are rewritten from them at every load and every served digest (CachedDecoder._cast_adapter).
    """

    a: torch.Tensor  # [R, E]: the group's A matrices stacked over their ranks, as published
    b: torch.Tensor  # [O, R]: block-diagonal; rows of untargeted projections stay 0
    scale: torch.Tensor  # [O, 1]: lora_alpha / r of the projection owning each output row
    slots: list[tuple[str, str, slice, slice]]  # (A name, B name, its rank columns, its output rows)
    a_cast: torch.Tensor  # [R, E] in the base's dtype: the last R rows of the group's extended base weight
    sb_cast: torch.Tensor  # [O, R] in the base's dtype: s B
    # every projection's (output rows, rank columns, s); an unadapted one has no rank columns and s = 0
    blocks: list[tuple[slice, slice, float]]

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def fixed_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """What the decode reads besides the adapter's named weights, and what it must be: B's entries outside the
        diagonal blocks (must be 0: they would mix one projection's rank columns into another's outputs) and each
        projection's rows of `scale` (must be its s). Shapes: views of b and of scale."""
        zeros, scales, values = [], [], []
        for rows, cols, s in self.blocks:
            zeros += [v for v in (self.b[rows, : cols.start], self.b[rows, cols.stop :]) if v.numel()]
            scales.append(self.scale[rows])
            values.append(float(torch.tensor(s, dtype=self.scale.dtype)))  # s as the buffer holds it (10 / 3 too)
        return zeros, scales, values


def lora_group(modules, names: dict[int, str], dtype: torch.dtype) -> LoraGroup | None:
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
    slots, blocks, r0, o0 = [], [], 0, 0
    for w, r, o in zip(adapted, ranks, outs):
        rows, cols = slice(r0, r0 + r), slice(o0, o0 + o)
        blocks.append((cols, rows, 0.0 if w is None else w[2]))
        if w is not None:
            lora_a, lora_b, s = w
            a[rows] = lora_a.detach()
            b[cols, rows] = lora_b.detach()
            scale[cols] = s
            slots.append((names[lora_a.data_ptr()], names[lora_b.data_ptr()], rows, cols))
        r0, o0 = r0 + r, o0 + o
    # a_cast is set by the caller: rows of the group's extended base weight (CachedDecoder._serving_weights)
    return LoraGroup(a, b, scale, slots, torch.empty(0, dtype=dtype), torch.empty_like(b, dtype=dtype), blocks)


def _base(module) -> torch.Tensor:
    """The base weight of a (possibly peft-wrapped) linear layer. Shapes: -> [out, in]."""
    return getattr(module, "base_layer", module).weight.detach()


def _bias(module) -> torch.Tensor | None:
    layer = getattr(module, "base_layer", module)
    return None if layer.bias is None else layer.bias.detach()


def _fuse(modules, extra_rows: int = 0) -> torch.Tensor:
    """The base weights of `modules` stacked into one [sum out + extra_rows, in] tensor (the extra rows zero: the
    adapter's A goes there); each module's own base weight becomes a view of its rows, so the fused copy is the
    only one held. Shapes: -> [sum out + extra_rows, in]."""
    weights = [_base(m) for m in modules]
    extra = weights[0].new_zeros(extra_rows, weights[0].shape[1])
    fused = torch.cat([*weights, extra])
    row = 0
    for m in modules:
        weight = getattr(m, "base_layer", m).weight
        weight.data = fused[row : row + weight.shape[0]]
        row += weight.shape[0]
    return fused


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen2 define it: normalize in fp32, cast back, then scale. Shapes: [..., E] -> [..., E]."""
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ("rotate half" form). Shapes: x [B, T, heads, D], cos/sin [B, T, 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class CachedDecoder:
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
        self.intermediate = cfg.intermediate_size
        # The fused CUDA decode (decode_fused) computes SiLU itself; another activation decodes eagerly.
        self.silu = getattr(cfg, "hidden_act", None) == "silu"
        from peft import get_peft_model_state_dict

        # Each LoRA weight's name in the adapter state dict the learner publishes, found by storage.
        names = {t.data_ptr(): k for k, t in get_peft_model_state_dict(peft_model).items()}
        self.weights = [self._serving_weights(layer, names) for layer in self.layers]
        self._cast_adapter()  # the serving copies of the adapter as built
        # The adapter as the decode step reads it: views of the serving buffers under the learner's names, made
        # once (a load copies into them; the served digest reads them). The buffers themselves never change
        # storage: CUDA graphs hold their addresses, so `served_digest` refuses buffers replaced since.
        self.views = self._adapter_views()
        self._fixed = self._fixed_parts()  # what the digest does not hash, as views of the same buffers
        self._storage = self._buffer_addresses()
        self._served: FlatCopy | None = None  # the served adapter packed for its digest (made at the first one)

    def _serving_weights(self, layer, names: dict[int, str]) -> dict[str, torch.Tensor | LoraGroup | None]:
        """Per projection group (q/k/v, o, gate/up, down): the base weights fused, with the adapter's A stacked
        under them, and the adapter beside them, unmerged: a bf16 merge W + s B A rounds small updates away (at
        lr 1e-5, 90% of q_proj entries were unchanged after 7 updates), while the learner applies LoRA unmerged."""
        a, m = layer.self_attn, layer.mlp
        dtype = _base(a.q_proj).dtype
        groups = {
            "qkv": (a.q_proj, a.k_proj, a.v_proj),  # [(H + 2Hkv) D, E]
            "o": (a.o_proj,),
            "gate_up": (m.gate_proj, m.up_proj),  # [2I, E]
            "down": (m.down_proj,),
        }
        weights: dict[str, torch.Tensor | LoraGroup | None] = {
            "norm1": layer.input_layernorm.weight,
            "norm2": layer.post_attention_layernorm.weight,
        }
        for group, modules in groups.items():
            lora = lora_group(modules, names, dtype)
            rank = 0 if lora is None else lora.rank
            fused = _fuse(modules, rank)  # [O + R, E]
            biases = [_bias(p) for p in modules]
            if lora is not None:
                lora.a_cast = fused[fused.shape[0] - rank :]
            weights[group] = fused
            weights[f"{group}_bias"] = None if biases[0] is None else torch.cat([*biases, biases[0].new_zeros(rank)])
            weights[f"{group}_lora"] = lora
        return weights

    def _loras(self) -> list[LoraGroup]:
        return [w[k] for w in self.weights for k in LORA_GROUPS if w[k] is not None]

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Write a new adapter into the serving buffers in place (CUDA graphs keep reading the same memory):
        adapter-sized copies only (one multi-tensor copy call), no merge, nothing read back from the device."""
        check_adapter_names(self.views, weights)
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
        served derives from exactly the bytes digested, and from what `_check_fixed_parts` finds as built (B's
        off-block zeros, s = lora_alpha / r). Refuses buffers whose storage changed since they were built: a CUDA
        graph captured before would still read the old memory, so their digest would not say what is served."""
        if self._buffer_addresses() != self._storage:
            raise PolicyMismatchError(
                "hf_cached's adapter buffers were replaced after the decoder was built; CUDA graphs captured"
                " before still read the old ones, so what the replica serves cannot be proven and the run stops."
                " A load must copy into the buffers in place (CachedDecoder.load)"
            )
        self._check_fixed_parts()
        self._cast_adapter()
        if self._served is None:
            self._served = FlatCopy(self.views)
        return self._served.digest()

    def _fixed_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """Every group's LoraGroup.fixed_parts together: B's off-block views, scale views, the scales' values."""
        zeros, scales, values = [], [], []
        for lora in self._loras():
            z, sc, v = lora.fixed_parts()
            zeros += z
            scales += sc
            values += v
        return zeros, scales, values

    def _check_fixed_parts(self) -> None:
        """The serving buffers' parts outside the digest are what they must be (LoraGroup.fixed_parts): the zeros
        of every block-diagonal B and the scales s = lora_alpha / r. One reduction over them all, one sync."""
        zeros, scales, values = self._fixed
        if not zeros and not scales:
            return
        off = [*torch._foreach_add(scales, [-v for v in values]), *zeros]
        worst = torch.stack(torch._foreach_norm(off, float("inf"))).max()
        if not worst.item() == 0:  # NaN fails too
            raise PolicyMismatchError(
                "hf_cached's serving buffers hold values outside the adapter's named weights (a non-zero entry off"
                " the block-diagonal B, or a scale other than lora_alpha / r): the decode would serve another"
                f" adapter than the digested one (largest deviation {worst.item():.3g}), so the run stops. A load"
                " must write the adapter's own blocks only (CachedDecoder.load)"
            )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the decoder holds beside the model's own parameters: the fused serving weights and biases,
        the adapter's buffers and the digest's flat copy (hf_cached's out-of-memory lines count them)."""
        held = [t for w in self.weights for t in w.values() if isinstance(t, torch.Tensor)]
        for lora in self._loras():
            held += [lora.a, lora.b, lora.scale, lora.a_cast, lora.sb_cast]
        return held + ([] if self._served is None else [self._served.flat])

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
    def _gemm(x: torch.Tensor, w: dict, group: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One (fused) projection's two GEMMs: the base weight (and bias) with the adapter's A stacked under it,
        then the unmerged adapter's term `(x A^T)(s B)^T` (models/lora.py `lora_delta`'s rounding), not yet added.
        Shapes: x [..., E] -> y [..., O + R] (base output, then x A^T), t [..., O] or None without an adapter."""
        y = F.linear(x, w[group], w[f"{group}_bias"])  # [..., O + R]
        lora = w[f"{group}_lora"]
        if lora is None:
            return y, None
        return y, F.linear(y[..., y.shape[-1] - lora.rank :], lora.sb_cast)

    @staticmethod
    def _project(x: torch.Tensor, w: dict, group: str) -> torch.Tensor:
        """One (fused) projection with its adapter's term added. Shapes: [..., E] -> [..., O]."""
        y, t = CachedDecoder._gemm(x, w, group)
        return y if t is None else y[..., : t.shape[-1]] + t

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Final-norm hidden states. `attend(layer, q, k, v)` stores this step's keys/values wherever the caller
        keeps them and returns the attention output over them (`attend` below, or a fused kernel).

        Shapes: ids, positions [B, T] -> [B, T, E]; attend gets q [B, T, H, D], k and v [B, T, Hkv, D] (q and k
        rotated) and returns [B, T, H * D].
        """
        b, t = ids.shape
        nq, nkv, d = self.heads, self.kv_heads, self.head_dim
        h = F.embedding(ids, self.embed)  # [B, T, E]
        cos, sin = self.rotary(h, positions)  # [B, T, D] each
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        for i, w in enumerate(self.weights):
            qkv = self._project(_rms_norm(h, w["norm1"], self.eps), w, "qkv").view(b, t, nq + 2 * nkv, d)
            qk = _rotate(qkv[:, :, : nq + nkv], cos, sin)  # [B, T, H + Hkv, D]
            attn = attend(i, qk[:, :, :nq], qk[:, :, nq:], qkv[:, :, nq + nkv :])  # [B, T, H * D]
            h = h + self._project(attn, w, "o")
            gate, up = self._project(_rms_norm(h, w["norm2"], self.eps), w, "gate_up").chunk(2, dim=-1)
            h = h + self._project(self.act(gate) * up, w, "down")
        return _rms_norm(h, self.final_norm, self.eps)

    def decode_fused(self, ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """One decode step's final-norm hidden states through the fused CUDA kernels (rollout/decode_kernels.py):
        per layer the four GEMM pairs of `_gemm` and three kernels, `attention(layer, y, t, cos, sin)` being the
        caller's cache-writing decode_attention. The same function as `hidden` for one token per row.

        Shapes: ids, positions [W] -> [W, E].
        """
        h = F.embedding(ids, self.embed)  # [W, E]
        cos, sin = self.rotary(h[:, None], positions[:, None])  # [W, 1, D] each
        cos, sin = cos[:, 0], sin[:, 0]
        x = _rms_norm(h, self.weights[0]["norm1"], self.eps)
        for i, w in enumerate(self.weights):
            y, t = self._gemm(x, w, "qkv")
            attn = attention(i, y, t, cos, sin)  # [W, H * D]
            h, x = decode_kernels.residual_norm(*self._gemm(attn, w, "o"), h, w["norm2"], self.eps)
            y, t = self._gemm(x, w, "gate_up")
            m = decode_kernels.silu_mul(y, t, self.intermediate)  # [W, I]
            after = self.weights[i + 1]["norm1"] if i + 1 < len(self.weights) else self.final_norm
            h, x = decode_kernels.residual_norm(*self._gemm(m, w, "down"), h, after, self.eps)
        return x

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
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
