"""The fast Hugging Face sampler: one prefill per prompt, a static KV cache, a CUDA-graph decode-and-sample step.

Same inputs, outputs and sampling code as hf_reference (the oracle), so the same weights and seeds give
the same tokens. What changes is the work per token:
- each prompt is prefilled once; its keys/values are copied into the cache slots of its n samples;
- keys/values live in buffers preallocated per layer (rollout/decode_cache.py); prompts are right-aligned at
  column P (the longest prompt), so every slot writes the same column each step;
- the decoder runs over fused serving weights with the adapter unmerged (rollout/cached_decoder.py);
- on CUDA, one whole step is captured as a CUDA graph per batch width and replayed: the decoder, the LM head,
  sampling (rollout/sampling.py: a counter-based draw per row and step, no generator state), the stop check
  and the writes of the sampled token and its log-prob into the output buffers. The host does not wait for a
  step: it replays graphs back to back and reads how many rows are still live only every DONE_CHECK_STEPS
  steps, and the outputs once, at the end (at rollout batch sizes launches and host syncs, not arithmetic,
  bounded the eager step and the step that synced to sample: lab/results/decode-profile.md);
- finished rows stay in their slots, writing nowhere, until the live rows fit a graph of half the width:
  then they are compacted out (at most log2(rows) times a call; eagerly, on the CPU, at every finish).
"""

from __future__ import annotations

import sys
import warnings

import torch

from miniverl.models.fused_head import head_logprobs
from miniverl.models.logprobs import token_logprobs
from miniverl.models.lora import LoraSettings, build_lora_model
from miniverl.process import CUDA_CAPTURE_LOCK, allocation_sites_note, release_cached_memory
from miniverl.rollout import Completion, decode_kernels
from miniverl.rollout.cached_decoder import CachedDecoder
from miniverl.rollout.decode_cache import DecodeCache
from miniverl.rollout.decode_kernels import decode_attention
from miniverl.rollout.hf_reference import left_pad
from miniverl.rollout.sampling import SamplingParams, sample_next
from miniverl.served_policy import probe_tolerance

# The strict-sync probe's last tokens go through the decode step itself (the CUDA graphs generate replays):
# a stale or wrong graph, not only stale weights, shows in the probe. 8 steps cost 8 decode launches.
PROBE_CHUNK_TOKENS = 512  # prefill positions per LM-head chunk of a probe (as models/logprobs.py)
PROBE_DECODE_STEPS = 8  # cache length rounds up to this, so slightly longer prompts reuse buffers and graphs
# With graphs the host learns how many rows are live (one sync) every this many steps: a sync drains the queue
# of replays, while a late answer only costs a few steps of rows that already stopped.
DONE_CHECK_STEPS = 8
PLAIN = SamplingParams(n=1, max_new_tokens=1)  # the graphs the probe replays before any generate call
# Padded prompt tokens per prefill pass of generate. The prefill's activations live beside the whole step's decode
# cache, and once freed their blocks stay reserved by torch's allocator, which the share's cap counts: in one pass,
# 64 prompts of 320 tokens held about 1.7 GiB at the 0.5B shape and left 1.35 GiB reserved, both a third of the 4080
# recipe's rollout share (lab/results/fit-planner.md). At 8k tokens a pass that recipe still ran out of its share
# at 322-token prompts (lab/results/peers.md, 2026-12-06, d0c451a); 4k tokens a pass hold half of that, and a pass of 4k
# tokens is still a large batch of GEMMs (by FLOPs the whole prefill is a few percent of a 512-token generate call). A
# pass that runs out of memory anyway is redone in passes of half as many prompts (the smaller size kept after).
PREFILL_TOKENS = 4096


def _mode(params: SamplingParams) -> tuple[float, int, float]:
    """What a captured step bakes in of the sampling settings (a graph per width and mode)."""
    return (params.temperature, params.top_k, params.top_p)


class HFCachedBackend:
    def __init__(self, model_path: str, lora: LoraSettings, dtype: torch.dtype, device: str) -> None:
        self.device = device
        self.model = build_lora_model(model_path, lora, dtype, device).eval()
        self.decoder = CachedDecoder(self.model)
        self.probe_tolerance = probe_tolerance(dtype)
        # Graphs only where CUDA is; the CPU path is the plain eager loop. Graphs rather than torch.compile:
        # compiling a 24-layer step takes minutes per batch width, more than a rollout takes.
        self.cuda_graphs = device.startswith("cuda")
        # The decode step through the fused Triton kernels where they run (rollout/decode_kernels.py); else eager.
        self.fused = decode_kernels.available(device, self.decoder.head_dim) and self.decoder.silu
        self._cache: DecodeCache | None = None
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None  # one memory pool for every graph of the cache: they never replay at once
        # One side stream for every capture's warm-up and the capture itself: cuBLAS keeps a workspace on each stream
        # a GEMM ran on (32 MiB on Hopper, allocated for the process's life), and a new stream per capture held ~0.8
        # GiB of them in the 4080 recipe's rollout at realistic shapes (lab/results/peers.md, 2026-12-06, 0724e28).
        self._capture_stream = None
        self._params = PLAIN  # the sampling settings of the last generate call (the probe replays its graphs)
        self._prefill_cap = sys.maxsize  # padded tokens a prefill pass, lowered below PREFILL_TOKENS by an OOM

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        """Only the adapter moves: into the serving buffers the decode step reads (the peft module's own
        LoRA weights are not used for serving and stay as built)."""
        self.decoder.load(weights)

    def served_digest(self) -> str:
        """The digest of the serving buffers the prefill and every decode step (and CUDA graph) read."""
        return self.decoder.served_digest()

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return self.decoder.adapter()

    @property
    def decode_mode(self) -> str:
        graphs = "cuda_graph" if self.cuda_graphs else "eager"
        return f"{graphs}+fused_kernels" if self.fused else graphs

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        self._check(prompts, params, seeds)
        n, rows = params.n, len(prompts) * params.n
        lengths = [len(p) for p in prompts for _ in range(n)]
        width_p = max(lengths)
        cache = self._reserve(rows, width_p + params.max_new_tokens)
        cache.start(seeds, params.stop_token_ids)
        self._params = params

        logits = self._prefill(prompts, n, cache)  # [R, V]
        lens = torch.tensor(lengths, device=self.device)
        cache.first_column[:rows] = width_p - lens
        cache.positions[:rows] = lens - 1  # bumped before each decode step: the first fed token sits at len(p)
        cache.column.fill_(width_p - 1)
        self._sample(logits, rows, params)  # step 0, from the prefill
        width = self._width(rows, rows)
        for step in range(1, params.max_new_tokens):
            if not self.cuda_graphs or step % DONE_CHECK_STEPS == 0:
                width = self._shrink(cache, width, rows)
                if width == 0:
                    break
            self._run_step(width, params)
        tokens, logprobs, stopped = cache.results(rows, params.max_new_tokens)
        return [Completion(t, lp, s) for t, lp, s in zip(tokens, logprobs, stopped)]

    def _shrink(self, cache: DecodeCache, width: int, rows: int) -> int:
        """The width the next steps decode at: 0 when every row stopped; narrower (live slots compacted to the
        front) when the live rows fit it. One host sync."""
        live = cache.live(width)
        count = int(live.sum())
        if count == 0:
            return 0
        narrower = self._width(count, rows)
        if narrower < width:
            cache.compact(live.nonzero().squeeze(1), width, narrower)
        return narrower

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
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop token ids must be in [0, {vocab}), got {params.stop_token_ids}")

    def _reserve(self, rows: int, columns: int) -> DecodeCache:
        """The cache, grown (never shrunk) to fit; growing drops the graphs that hold the old buffers. The old
        buffers are released before the new ones are allocated, so the two never coexist."""
        if self._cache is not None and self._cache.fits(rows, columns):
            return self._cache
        if self._cache is not None:
            rows, columns = max(rows, self._cache.rows), max(columns, self._cache.columns)
        self._cache, self._graphs, self._pool = None, {}, None
        d = self.decoder
        self._cache = DecodeCache.allocate(
            rows, columns, len(d.layers), d.kv_heads, d.head_dim, d.vocab_size, d.embed.dtype, self.device
        )
        return self._cache

    def _prefill(self, prompts: list[list[int]], n: int, cache: DecodeCache) -> torch.Tensor:
        """Run each prompt once, copy its keys/values into its n rows, return next-token logits per row. The prompts
        go through in passes of at most PREFILL_TOKENS padded tokens (whole prompts, at least one a pass), so the
        prefill's activations stay that size beside the whole step's decode cache. A pass that runs out of GPU
        memory is redone at half as many prompts, down to one (then the error stands); later calls keep the size.

        Shapes: -> [G * N, V].
        """
        width = max(map(len, prompts))
        per_pass = max(1, min(PREFILL_TOKENS, self._prefill_cap) // width)
        logits, first = None, 0  # [G, N, V], filled pass by pass (a list and a cat would hold it twice at the end)
        while first < len(prompts):
            try:
                h = self._prefill_hidden(prompts[first : first + per_pass], n, cache, first * n, width)  # [g, P, E]
                last = self.decoder.lm_head(h[:, -1])  # [g, V]
                if logits is None:
                    logits = last.new_empty(len(prompts), n, last.shape[-1])
                logits[first : first + last.shape[0]] = last[:, None]  # each prompt's logits in its N rows
            except torch.OutOfMemoryError as e:
                if per_pass == 1:
                    raise
                error = str(e).split(". ")[0]
            else:
                first += per_pass
                continue
            # with the failed pass's tensors (freed with the exception), their blocks go back to the card
            h = last = None
            per_pass //= 2
            self._prefill_cap = per_pass * width
            release_cached_memory(self.device)
            print(
                f"rollout: out of GPU memory in a prefill pass ({error}){self._memory_note()}; redoing it in passes"
                f" of {per_pass} prompts ({per_pass * width} padded tokens), kept for later calls. To avoid the"
                " retry: a larger resources.rollout.num_gpus, or shorter data.max_prompt_length",
                flush=True,
            )
        return logits.flatten(0, 1)

    def _prefill_hidden(
        self, prompts: list[list[int]], n: int, cache: DecodeCache, first_row: int = 0, width: int = 0
    ) -> torch.Tensor:
        """One prefill pass: prompts left-padded to `width` columns (at least their longest), keys/values copied into
        the cache rows of their n samples from `first_row` on.

        Shapes: -> [G, P, E] final-norm hidden states, prompts right-aligned at column P.
        """
        ids, mask = left_pad(prompts, width=width)  # [G, P] each
        g, p = ids.shape
        rows = slice(first_row, first_row + g * n)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
        # A padding query may see itself, so no softmax row is all -inf (NaN would reach real rows via 0 * NaN).
        allowed = (causal & mask.bool()[:, None, :]) | torch.eye(p, dtype=torch.bool, device=self.device)
        bias = torch.zeros(g, 1, p, p, device=self.device).masked_fill(~allowed[:, None], float("-inf"))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [G, Hkv, P, D]
            cache.keys[layer][rows, :, :p] = k.repeat_interleave(n, dim=0)
            cache.values[layer][rows, :, :p] = v.repeat_interleave(n, dim=0)
            return self.decoder.attend(q.transpose(1, 2), k, v, bias)

        return self.decoder.hidden(ids, positions, attend)  # [G, P, E]

    def _sample(self, logits: torch.Tensor, width: int, params: SamplingParams) -> None:
        """Sample the next token of the first `width` slots and record it in their rows' outputs; a slot whose
        token is a stop token writes the scratch row from then on. Runs inside the captured step.
        Shapes: logits [width, V]."""
        c = self._cache
        tokens, logprobs = sample_next(logits, params, c.seeds[:width], c.step)
        dest = c.dest[:width]
        at = c.step.expand(width)
        c.out_tokens.index_put_((dest, at), tokens)
        c.out_logprobs.index_put_((dest, at), logprobs)
        c.out_length.index_put_((dest,), at + 1)
        stopped = c.is_stop[tokens]  # [width] bool
        c.out_stopped.index_put_((dest,), stopped)
        c.dest[:width] = torch.where(stopped, c.rows, dest)
        c.tokens[:width] = tokens

    def _step(self, width: int, params: SamplingParams) -> torch.Tensor:
        """One whole step for the first `width` slots: advance, feed cache.tokens at the next column, sample.
        The body a CUDA graph captures. Shapes: -> logits [width, V]."""
        c = self._cache
        c.positions[:width] += 1
        c.column += 1
        c.step += 1
        logits = self._decode_step(width)
        self._sample(logits, width, params)
        return logits

    def _decode_step(self, width: int) -> torch.Tensor:
        """Feed cache.tokens[:width] at cache.column. Shapes: -> [width, V]."""
        c, d = self._cache, self.decoder
        if self.fused:

            def attention(layer: int, y: torch.Tensor, t, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
                return decode_attention(
                    y, t, cos, sin, c.keys[layer], c.values[layer], c.column, c.first_column, d.heads, d.scaling
                )

            return d.lm_head(d.decode_fused(c.tokens[:width], c.positions[:width], attention))
        visible = (c.arange >= c.first_column[:width, None]) & (c.arange <= c.column)  # [W, L]
        bias = torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = c.keys[layer][:width], c.values[layer][:width]
            keys.index_copy_(2, c.column, k.transpose(1, 2))
            values.index_copy_(2, c.column, v.transpose(1, 2))
            return d.attend(q.transpose(1, 2), keys, values, bias[:, None, None, :])

        h = d.hidden(c.tokens[:width, None], c.positions[:width, None], attend)  # [W, 1, E]
        return d.lm_head(h[:, -1])

    def _run_step(self, width: int, params: SamplingParams) -> torch.Tensor:
        if not self.cuda_graphs:
            return self._step(width, params)
        key = (width, _mode(params))
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture_fitting(width, params)
            except RuntimeError as e:  # keep serving, but say so: the speed claim no longer holds
                warnings.warn(
                    f"hf_cached: CUDA graph capture failed ({e}){self._memory_note()}; decoding eagerly", stacklevel=2
                )
                self.cuda_graphs = False
                return self._step(width, params)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def _capture_fitting(self, width: int, params: SamplingParams) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture one step; if that runs out of GPU memory, give the allocator's cache back and capture once more.
        Inside a capture the allocator cannot free its cached blocks to make room, so blocks left reserved by the
        prefill passes and the warm-up's stream can fail a capture that fits once they are freed (the 4080 recipe
        at 322-token prompts: 32 MiB refused with 177 MiB reserved unused, lab/results/peers.md, 2026-12-06,
        b7f057d)."""
        try:
            return self._capture(width, params)
        except torch.OutOfMemoryError as e:
            error = str(e).split(". ")[0]
            note = self._memory_note()
        release_cached_memory(self.device)
        print(
            f"rollout: a CUDA graph capture at width {width} ran out of GPU memory ({error}){note}; the allocator's"
            " cache given back, capturing once more",
            flush=True,
        )
        return self._capture(width, params)

    def _capture(self, width: int, params: SamplingParams) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture one step, its warm-up and the capture on the backend's one side stream (`_capture_stream`). The
        warm-up runs first (lazy cuBLAS state); it advances the state, so the small state tensors are put back after
        it, also when it fails (the step redone eagerly or captured again must start where this one did). Its writes
        to the cache and outputs are the ones the replay that follows the capture makes again, with the same values."""
        c = self._cache
        state = (c.tokens, c.positions, c.column, c.step, c.dest)
        saved = [t.clone() for t in state]
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            try:
                self._step(width, params)
            finally:
                for t, s in zip(state, saved):
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a profiler, a memory poll, a colocated learner) must not break
        # the capture; the lock keeps that learner's cache release out of it (miniverl/process.py).
        graphing = torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local")
        with CUDA_CAPTURE_LOCK, graphing:
            logits = self._step(width, params)
        return graph, logits

    def _memory_note(self) -> str:
        """Where this process's GPU memory is, for an out-of-memory line (empty off CUDA): what is allocated, split
        into the model with its serving buffers, the decode cache and the rest, and what the allocator keeps
        reserved unused (the share's cap counts reserved memory). Read after the failed pass's tensors are freed."""
        if not self.device.startswith("cuda"):
            return ""
        storages = {}  # each storage once: the peft module's base weights are views of the fused serving weights
        for t in (*self.model.parameters(), *self.model.buffers(), *self.decoder.tensors()):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        model, cache = sum(storages.values()), 0 if self._cache is None else self._cache.nbytes
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        gib = 2**30
        return (
            f"; {allocated / gib:.2f} GiB allocated (model and adapter {model / gib:.2f}, decode cache"
            f" {cache / gib:.2f}, the rest {(allocated - model - cache) / gib:.2f}), {(reserved - allocated) / gib:.2f}"
            f" reserved unused{allocation_sites_note()}"
        )

    def _width(self, live: int, rows: int) -> int:
        """Slots a decode step computes: exactly the live rows eagerly; the next power of two with graphs."""
        if not self.cuda_graphs:
            return live
        return min(rows, 1 << (live - 1).bit_length())

    @torch.no_grad()
    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced through the path that samples: the serving weights and adapter buffers (never the
        peft module), the prefill over all but each sequence's last PROBE_DECODE_STEPS + 1 tokens, then up
        to PROBE_DECODE_STEPS whole steps over the KV cache (on a GPU, replays of the CUDA graphs generate
        replays, sampling and all, with every slot writing the scratch row).
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
        cache.start([0] * rows, ())
        cache.dest.fill_(cache.rows)  # teacher-forced: nothing is recorded
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
            logits = self._run_step(self._width(rows, rows), self._params)[:rows]  # [R, V]
            ids = torch.tensor([s[n + step + 1] for s, n in zip(sequences, lens)], device=self.device)
            decoded.append(token_logprobs(logits[:, None], ids[:, None])[:, 0])
        flat = prefill.tolist()
        steps = torch.stack(decoded, dim=1).tolist() if decoded else [[] for _ in lens]  # [R, tail - 1]
        out, start = [], 0
        for n, tail_lp in zip(lens, steps):
            out.append(flat[start : start + n] + tail_lp)
            start += n
        return out
