"""hf_cached's decode state: the KV cache and everything a decode step reads or writes, in fixed buffers.

A CUDA graph replays kernels on the addresses it captured, so every tensor a decode step touches lives here,
allocated once for `rows` x `columns` and rewritten in place: the keys/values, the token each slot feeds next,
its position, the step counter, each slot's row seed (sampling runs inside the graph, rollout/sampling.py) and
the outputs (sampled tokens and log-probs per row and step, each row's length and stop flag). The host reads
the outputs once, at the end of a call.

Slots and rows: a call's rows start in slots 0..R-1 in order. Finished rows stay in their slot (their work is
wasted, not wrong) until the live rows fit a narrower graph; then `compact` moves the live slots to the front.
`dest[slot]` is the output row a slot writes; a finished or padding slot writes the scratch row (index
`rows`), so nothing is ever written after a row's stop token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CACHE_COLUMN_QUANTUM = 64  # columns grow in these steps, so slightly longer prompts reuse buffers and graphs


@dataclass
class DecodeCache:
    """Buffers preallocated for `rows` x `columns`; decode reads and writes them in place."""

    keys: list[torch.Tensor]  # per layer [R, Hkv, L, D]
    values: list[torch.Tensor]  # per layer [R, Hkv, L, D]
    tokens: torch.Tensor  # [R] long: the token each slot feeds next
    positions: torch.Tensor  # [R] long: its position id
    first_column: torch.Tensor  # [R] long: first cache column holding a real prompt token
    column: torch.Tensor  # [1] long: the column this step writes
    arange: torch.Tensor  # [L] long
    seeds: torch.Tensor  # [R] long: each slot's row seed (rollout/sampling.py counter_uniforms)
    dest: torch.Tensor  # [R] long: the output row each slot writes; `rows` (the scratch row) once done
    step: torch.Tensor  # [1] long: the index of the token being sampled
    out_tokens: torch.Tensor  # [R + 1, L] long: sampled tokens per row and step (row R: scratch)
    out_logprobs: torch.Tensor  # [R + 1, L] float32: their raw log-probs
    out_length: torch.Tensor  # [R + 1] long: tokens written per row
    out_stopped: torch.Tensor  # [R + 1] bool: the row's last token is a stop token
    is_stop: torch.Tensor  # [V] bool: the call's stop tokens

    @classmethod
    def allocate(
        cls, rows: int, columns: int, layers: int, kv_heads: int, head_dim: int, vocab: int, dtype, device
    ) -> DecodeCache:
        columns = -(-columns // CACHE_COLUMN_QUANTUM) * CACHE_COLUMN_QUANTUM
        shape = (rows, kv_heads, columns, head_dim)
        long = dict(dtype=torch.long, device=device)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            tokens=torch.zeros(rows, **long),
            positions=torch.zeros(rows, **long),
            first_column=torch.zeros(rows, **long),
            column=torch.zeros(1, **long),
            arange=torch.arange(columns, **long),
            seeds=torch.zeros(rows, **long),
            dest=torch.full((rows,), rows, **long),
            step=torch.zeros(1, **long),
            out_tokens=torch.zeros(rows + 1, columns, **long),
            out_logprobs=torch.zeros(rows + 1, columns, dtype=torch.float32, device=device),
            out_length=torch.zeros(rows + 1, **long),
            out_stopped=torch.zeros(rows + 1, dtype=torch.bool, device=device),
            is_stop=torch.zeros(vocab, dtype=torch.bool, device=device),
        )

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the cache holds (keys and values above all)."""
        tensors = [*self.keys, *self.values]
        tensors += [v for v in vars(self).values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def columns(self) -> int:
        return self.arange.shape[0]

    def fits(self, rows: int, columns: int) -> bool:
        return self.rows >= rows and self.columns >= columns

    def start(self, seeds: list[int], stop_token_ids: tuple[int, ...]) -> None:
        """A new call of len(seeds) rows: row i in slot i, writing output row i; every other slot writes the
        scratch row. Stale keys/values are zeroed: masked columns are still read as 0 * value, so they must be
        finite."""
        n = len(seeds)
        for buf in (*self.keys, *self.values):
            buf.zero_()
        self.seeds[:n] = torch.tensor(seeds, dtype=torch.long)
        self.dest.fill_(self.rows)
        self.dest[:n] = torch.arange(n, device=self.dest.device)
        self.step.zero_()
        self.out_length.zero_()
        self.out_stopped.zero_()
        self.is_stop.zero_()
        if stop_token_ids:
            self.is_stop[torch.tensor(stop_token_ids, device=self.is_stop.device)] = True

    def live(self, width: int) -> torch.Tensor:
        """Shapes: -> [width] bool, the slots whose row has not stopped."""
        return self.dest[:width] < self.rows

    def compact(self, keep: torch.Tensor, width: int, new_width: int) -> None:
        """Move the slots `keep` (indices below `width`, in order) to the front; slots after them up to
        `new_width` become padding that writes the scratch row."""
        m = keep.numel()
        for buf in (*self.keys, *self.values, self.tokens, self.positions, self.first_column, self.seeds, self.dest):
            buf[:m] = buf[:width].index_select(0, keep)
        self.dest[m:new_width] = self.rows

    def results(self, rows: int, max_new_tokens: int) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """Each row's tokens, log-probs and stop flag, copied to the host in one go."""
        lengths = self.out_length[:rows].tolist()
        tokens = self.out_tokens[:rows, :max_new_tokens].tolist()
        logprobs = self.out_logprobs[:rows, :max_new_tokens].tolist()
        stopped = self.out_stopped[:rows].tolist()
        return (
            [t[:n] for t, n in zip(tokens, lengths)],
            [lp[:n] for lp, n in zip(logprobs, lengths)],
            stopped,
        )
