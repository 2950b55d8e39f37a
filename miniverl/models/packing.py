"""Micro-batches by tokens: rows sorted by length, grouped under a token budget, laid out without inner padding.

The rollout hands over rows as [left-padded prompt | right-padded response]. For a forward pass the learner
and the scorer re-lay each row as [prompt | response | trailing pad]: a causal model never looks right, so
trailing padding needs no attention mask and the real tokens sit at positions 0..L-1 as in an unpadded
forward. Rows are sorted by length before grouping, so the trailing padding of a micro-batch is small, and a
micro-batch holds as many rows as fit `max_tokens` padded tokens (rows x longest row), not a fixed row count:
short rows share a forward, a long one does not overrun the memory the budget was sized for.

`packed_hidden` runs the decoder alone; the LM head then reads its final hidden states chunk by chunk
(models/fused_head.py). `lm_parts` splits a causal LM into those two and refuses models whose logits are not
head(hidden state).

Shapes: B rows, Tp / Tr prompt / response columns, L longest real row of a micro-batch, N response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miniverl.batches import RolloutBatch
from miniverl.errors import ConfigError


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch: longest rows first, each group's rows x longest row <= `max_tokens`.

    A row longer than `max_tokens` gets a micro-batch of its own (validation refuses a budget below the
    longest possible row, so this only happens when the budget was set for shorter data). A last group of one
    row takes the shortest row of the group before it when that one keeps two: the compiled learner's layers
    (models/compiled.py) compile separate variants for a one-row micro-batch (dynamo specializes size 1), seconds
    each on a GPU at the first step that happens to leave one row over. Both still fit: the moved row is at most
    the longest of its old group, which held three or more.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) > 1 and len(groups[-1]) == 1 and len(groups[-2]) >= 3:
        groups[-1].insert(0, groups[-2].pop())  # the shortest of the group before, longest-first order kept
    return groups


def row_lengths(batch: RolloutBatch) -> list[int]:
    """Real tokens of each row: prompt tokens + response tokens up to and including the first stop."""
    return (batch.prompt_mask.sum(1) + batch.response_mask.sum(1)).tolist()


def batch_micro_batches(batch: RolloutBatch, max_tokens: int, rows: int) -> list[list[int]]:
    """plan_micro_batches over `batch`'s rows under `max_tokens`, or, when it is 0, under `rows` rows of the
    batch's longest row (the CPU's row-count micro-batches, trainer.micro_batch_size)."""
    lengths = row_lengths(batch)
    return plan_micro_batches(lengths, max_tokens or rows * max(lengths))


@dataclass(frozen=True)
class PackedRows:
    """Some rows of a batch as one right-padded forward, and where their response tokens sit.

    `predictors` index the flattened [b * L] positions whose output predicts each response token (position
    prompt_len - 1 + t predicts response t); `rows` / `cols` are the batch row and response column of each of
    those N tokens, in the same order, so per-token results scatter back into [B, Tr].
    """

    input_ids: torch.Tensor  # [b, L] long, right-padded with 0
    predictors: torch.Tensor  # [N] long into the flattened [b * L]
    rows: torch.Tensor  # [N] long, batch row of each response token
    cols: torch.Tensor  # [N] long, response column of each response token
    targets: torch.Tensor  # [N] long, the sampled token ids

    @property
    def num_tokens(self) -> int:
        return int(self.targets.shape[0])


def pack_rows(batch: RolloutBatch, rows: list[int]) -> PackedRows:
    """Lay `rows` of `batch` out as [prompt | response | pad] (see the module note). CPU tensors."""
    prompt_lens = batch.prompt_mask[rows].sum(1).tolist()
    response_lens = batch.response_mask[rows].sum(1).tolist()
    width = max(p + r for p, r in zip(prompt_lens, response_lens))
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    predictors, row_ids, col_ids = [], [], []
    tp = batch.prompts.shape[1]
    for j, (i, p, r) in enumerate(zip(rows, prompt_lens, response_lens)):
        input_ids[j, :p] = batch.prompts[i, tp - p :]  # prompts are left-padded: the real ones are last
        input_ids[j, p : p + r] = batch.responses[i, :r]
        predictors.append(torch.arange(r) + j * width + p - 1)
        row_ids.append(torch.full((r,), i, dtype=torch.long))
        col_ids.append(torch.arange(r))
    rows_t, cols_t = torch.cat(row_ids), torch.cat(col_ids)
    return PackedRows(input_ids, torch.cat(predictors), rows_t, cols_t, batch.responses[rows_t, cols_t])


def packed_hidden(model, packed: PackedRows) -> tuple[torch.Tensor, torch.nn.Module]:
    """Final hidden states at the positions that predict the packed response tokens, and the LM head.

    No attention mask: padding is trailing, so a causal model's real positions never see it (SDPA then takes
    its causal kernel). Shapes: -> hidden [N, H] in the model's dtype.
    """
    decoder, head = lm_parts(model)
    device = next(model.parameters()).device
    out = decoder(input_ids=packed.input_ids.to(device), use_cache=False).last_hidden_state  # [b, L, H]
    return out.reshape(-1, out.shape[-1])[packed.predictors.to(device)], head


# Model config attributes that make the logits something other than lm_head(final hidden state); the
# fused and packed paths apply only the LM head, so they refuse such models instead of computing other numbers.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def check_plain_logits(config, field: str) -> None:
    """Refuse a model whose logits are not lm_head(final hidden state): the learner's fused LM-head loss and
    the scorer apply the head alone, so they would compute other numbers for it."""
    changed = [k for k in LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1.0)]
    if changed:
        raise ConfigError(
            f"{field} is a {config.model_type} model that transforms its logits ({', '.join(changed)}); the learner"
            " and the scorer compute logits as lm_head(hidden state) chunk by chunk and do not reproduce that, so"
            " such models are not supported yet: pick a model without logit soft-capping or scaling"
        )


def lm_parts(model):
    """(decoder, LM head) of a causal LM, peft-wrapped or not: logits = head(decoder(...).last_hidden_state)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    check_plain_logits(base.config, "the model")
    return base.get_decoder(), base.get_output_embeddings()
