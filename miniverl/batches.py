"""Typed batches that travel between the actors, validated on construction.

Key names follow verl (see DESIGN.md) so the bridge stays thin. Shapes use one alphabet:
B batch rows, G prompt groups, N samples per group (B = G * N), Tp prompt tokens, Tr response
tokens, V vocabulary, K teacher top-k support.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from miniverl.errors import BatchError, PolicyMismatchError

# The data_source of rows that did not say where they came from (verl's key; it picks the reward).
DEFAULT_DATA_SOURCE = "unknown"


def _per_row(values: list | None, fill, count: int) -> list:
    return [fill() if callable(fill) else fill for _ in range(count)] if values is None else values


@dataclass
class PromptBatch:
    """G prompts as unpadded token ids, one `uid` each, the answer its reward checks against, and the
    verl `data_source` (which reward scores it) and `extra_info` (passed to a user's reward) of each row."""

    prompt_ids: list[list[int]]
    uid: list[str]
    ground_truth: list[str]
    data_source: list[str] | None = None  # [G]; None = DEFAULT_DATA_SOURCE for every row
    extra_info: list[dict] | None = None  # [G]; None = {} for every row
    # [G] unpadded ids of what the teacher sees before the response instead of the prompt (privileged context,
    # data.teacher_demonstrations); None = the teacher scores the student's prompt
    teacher_prompt_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        g = len(self.prompt_ids)
        if g == 0:
            raise BatchError("PromptBatch is empty: pass at least one prompt")
        self.data_source = _per_row(self.data_source, DEFAULT_DATA_SOURCE, g)
        self.extra_info = _per_row(self.extra_info, dict, g)
        if len(self.uid) != g or len(self.ground_truth) != g:
            raise BatchError(
                f"PromptBatch has {g} prompts but {len(self.uid)} uids and {len(self.ground_truth)} answers;"
                " give one uid and one answer per prompt"
            )
        if len(self.data_source) != g or len(self.extra_info) != g:
            raise BatchError(
                f"PromptBatch has {g} prompts but {len(self.data_source)} data_source and"
                f" {len(self.extra_info)} extra_info entries; give one of each per prompt"
            )
        if len(set(self.uid)) != g:
            raise BatchError("PromptBatch uids must be unique: each prompt is one group")
        for i, ids in enumerate(self.prompt_ids):
            if len(ids) == 0:
                raise BatchError(f"prompt {i} ({self.uid[i]}) has no tokens")
        if self.teacher_prompt_ids is not None and (
            len(self.teacher_prompt_ids) != g or not all(self.teacher_prompt_ids)
        ):
            raise BatchError(f"PromptBatch has {g} prompts: give one non-empty teacher prompt per prompt, or None")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: list[int]) -> PromptBatch:
        return PromptBatch(
            [self.prompt_ids[i] for i in idx],
            [self.uid[i] for i in idx],
            [self.ground_truth[i] for i in idx],
            [self.data_source[i] for i in idx],
            [self.extra_info[i] for i in idx],
            None if self.teacher_prompt_ids is None else [self.teacher_prompt_ids[i] for i in idx],
        )


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise BatchError(msg)


def _is_binary(mask: torch.Tensor) -> bool:
    return bool(((mask == 0) | (mask == 1)).all())


def _check_padding_side(mask: torch.Tensor, side: str, name: str) -> None:
    """Right padding: ones then zeros in every row; left padding: zeros then ones."""
    m = mask.long()
    steps = m[:, 1:] - m[:, :-1]  # [B, T-1]
    bad = (steps > 0) if side == "right" else (steps < 0)
    rows = bad.any(dim=1).nonzero().flatten().tolist()
    _check(not rows, f"{name} must be {side}-padded (contiguous ones); rows {rows[:8]} are not")


_TOKEN_ID_FIELDS = ("prompts", "responses", "teacher_prompts")  # [B, T] long in a process; int32 in transit
_MASK_FIELDS = ("prompt_mask", "response_mask", "teacher_prompt_mask")  # long in a process; bool in transit


@dataclass
class RolloutBatch:
    """B = G * N sampled responses, rows grouped by prompt (all N samples of a uid are adjacent).

    `rollout_log_probs` is the sampler's log-prob of each sampled token under the untempered,
    untruncated policy (vLLM's default `raw_logprobs`), 0 where `response_mask` is 0.
    `response_mask` is 1 on every sampled token up to and including the first EOS.
    """

    prompts: torch.Tensor  # [B, Tp] long, left-padded
    prompt_mask: torch.Tensor  # [B, Tp] long, 1 = real prompt token
    responses: torch.Tensor  # [B, Tr] long, right-padded
    response_mask: torch.Tensor  # [B, Tr] long
    rollout_log_probs: torch.Tensor  # [B, Tr] float32
    uid: list[str]  # [B]
    ground_truth: list[str]  # [B]
    policy_version: int
    finished: torch.Tensor = field(default=None)  # [B] bool, True when the row ended with a stop token
    data_source: list[str] | None = None  # [B]; None = DEFAULT_DATA_SOURCE (picks each row's reward)
    extra_info: list[dict] | None = None  # [B]; None = {}
    # What the teacher sees before each response instead of `prompts` (PromptBatch.teacher_prompt_ids), or None
    teacher_prompts: torch.Tensor | None = None  # [B, Tq] long, left-padded
    teacher_prompt_mask: torch.Tensor | None = None  # [B, Tq] long

    def __post_init__(self) -> None:
        b = self.prompts.shape[0]
        if self.finished is None:
            self.finished = torch.zeros(b, dtype=torch.bool)
        self.data_source = _per_row(self.data_source, DEFAULT_DATA_SOURCE, b)
        self.extra_info = _per_row(self.extra_info, dict, b)
        _check(
            len(self.data_source) == b and len(self.extra_info) == b,
            f"need {b} data_source and extra_info entries, got {len(self.data_source)} and {len(self.extra_info)}",
        )
        _check(self.prompts.dim() == 2 and self.responses.dim() == 2, "prompts and responses must be [B, T]")
        _check(
            self.prompt_mask.shape == self.prompts.shape,
            f"prompt_mask {tuple(self.prompt_mask.shape)} != prompts {tuple(self.prompts.shape)}",
        )
        for name in ("response_mask", "rollout_log_probs"):
            t = getattr(self, name)
            _check(
                t.shape == self.responses.shape,
                f"{name} {tuple(t.shape)} != responses {tuple(self.responses.shape)}",
            )
        _check(self.responses.shape[0] == b, f"responses have {self.responses.shape[0]} rows, prompts {b}")
        for name in ("prompts", "prompt_mask", "responses", "response_mask"):
            _check(getattr(self, name).dtype == torch.long, f"{name} must be torch.long")
        _check(self.rollout_log_probs.dtype == torch.float32, "rollout_log_probs must be float32")
        _check(len(self.uid) == b and len(self.ground_truth) == b, f"need {b} uids and answers")
        _check(self.finished.shape == (b,), f"finished must be [B]={b}")
        _check(_is_binary(self.prompt_mask) and _is_binary(self.response_mask), "masks must be 0/1")
        _check(bool((self.prompt_mask.sum(1) > 0).all()), "every row needs at least one prompt token")
        _check_padding_side(self.prompt_mask, "left", "prompt_mask")
        _check_padding_side(self.response_mask, "right", "response_mask")
        _check((self.teacher_prompts is None) == (self.teacher_prompt_mask is None), "teacher prompts need their mask")
        if self.teacher_prompts is not None:
            tq, mq = self.teacher_prompts, self.teacher_prompt_mask
            _check(tq.dim() == 2 and tq.shape[0] == b and mq.shape == tq.shape, f"teacher_prompts must be [B={b}, Tq]")
            _check(tq.dtype == torch.long and mq.dtype == torch.long, "teacher_prompts and mask must be torch.long")
            _check(_is_binary(mq) and bool((mq.sum(1) > 0).all()), "every row needs a teacher prompt token (0/1 mask)")
            _check_padding_side(mq, "left", "teacher_prompt_mask")
        _check(bool(torch.isfinite(self.rollout_log_probs).all()), "rollout_log_probs must be finite")
        _check(bool((self.rollout_log_probs <= 0).all()), "rollout_log_probs must be <= 0")
        _check(
            bool((self.rollout_log_probs[self.response_mask == 0] == 0).all()),
            "rollout_log_probs must be 0 outside response_mask",
        )
        _check(self.policy_version >= 0, "policy_version must be >= 0")
        seen: set[str] = set()
        for i, u in enumerate(self.uid):  # groups must be contiguous runs of rows
            if i > 0 and u != self.uid[i - 1]:
                _check(u not in seen, f"rows of uid {u!r} are not adjacent; keep each group contiguous")
            seen.add(u)

    def __len__(self) -> int:
        return self.prompts.shape[0]

    # Between processes (Ray's object store, actor to actor) the token ids travel as int32 and the masks as
    # bool: 4 + 1 bytes per token instead of 8 + 8. Token ids are vocabulary indices (< 2**31 for any
    # tokenizer) and the masks were checked 0/1 on construction, so the round trip is exact; the receiver
    # gets long tensors again, because embedding lookups and gathers on several paths need long indices.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in _TOKEN_ID_FIELDS:
            state[name] = None if state.get(name) is None else state[name].to(torch.int32)
        for name in _MASK_FIELDS:
            state[name] = None if state.get(name) is None else state[name].bool()
        return state

    def __setstate__(self, state: dict) -> None:
        for name in (*_TOKEN_ID_FIELDS, *_MASK_FIELDS):
            state[name] = None if state.get(name) is None else state[name].long()
        self.__dict__.update(state)

    def teacher_view(self) -> RolloutBatch:
        """The batch as the teacher scores it: its teacher prompts in place of the prompts (the responses, and so
        every [B, Tr] score position, unchanged); the batch itself when it has none."""
        if self.teacher_prompts is None:
            return self
        fields = {**self.__dict__, "prompts": self.teacher_prompts, "prompt_mask": self.teacher_prompt_mask}
        return _unchecked(RolloutBatch, **fields)

    @property
    def input_ids(self) -> torch.Tensor:  # [B, Tp + Tr]
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # [B, Tp + Tr]
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:  # [B, Tp + Tr]
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    def rows(self, start: int, stop: int) -> RolloutBatch:
        """Rows [start, stop) as a batch (micro-batching in the learner). Not validated again: the rows of a
        validated batch are valid (validation is O(B x T) and belongs at the boundaries, where a batch is
        built, not at every slice)."""
        return _unchecked(
            RolloutBatch,
            prompts=self.prompts[start:stop],
            prompt_mask=self.prompt_mask[start:stop],
            responses=self.responses[start:stop],
            response_mask=self.response_mask[start:stop],
            rollout_log_probs=self.rollout_log_probs[start:stop],
            uid=self.uid[start:stop],
            ground_truth=self.ground_truth[start:stop],
            policy_version=self.policy_version,
            finished=self.finished[start:stop],
            data_source=self.data_source[start:stop],
            extra_info=self.extra_info[start:stop],
            teacher_prompts=None if self.teacher_prompts is None else self.teacher_prompts[start:stop],
            teacher_prompt_mask=None if self.teacher_prompt_mask is None else self.teacher_prompt_mask[start:stop],
        )

    def select(self, rows: list[int]) -> RolloutBatch:
        """The batch's `rows`, in that order, at the same padded widths (Tp, Tr); the batch itself for all rows.
        Validated again: a selection must keep every uid group contiguous."""
        if rows == list(range(len(self))):
            return self
        idx = torch.tensor(rows, dtype=torch.long)
        return RolloutBatch(
            prompts=self.prompts[idx],
            prompt_mask=self.prompt_mask[idx],
            responses=self.responses[idx],
            response_mask=self.response_mask[idx],
            rollout_log_probs=self.rollout_log_probs[idx],
            uid=[self.uid[i] for i in rows],
            ground_truth=[self.ground_truth[i] for i in rows],
            policy_version=self.policy_version,
            finished=self.finished[idx],
            data_source=[self.data_source[i] for i in rows],
            extra_info=[self.extra_info[i] for i in rows],
            teacher_prompts=None if self.teacher_prompts is None else self.teacher_prompts[idx],
            teacher_prompt_mask=None if self.teacher_prompt_mask is None else self.teacher_prompt_mask[idx],
        )


@dataclass
class TeacherScores:
    """The teacher's view of a RolloutBatch.

    `teacher_log_probs` is log p(y_t | s_t) of each sampled token at temperature 1 (for PG-k1 and the
    reverse-KL metric). The support is for GKD, computed at the loss temperature: either the full
    distribution (`teacher_topk_ids` is None, last dim V) or the teacher's top-K tokens with the exact
    log-mass of the rest (`teacher_tail_logprob`).
    """

    teacher_log_probs: torch.Tensor  # [B, Tr] float32, 0 outside the response mask
    teacher_topk_logprobs: torch.Tensor | None = None  # [B, Tr, K] or [B, Tr, V] float32
    teacher_topk_ids: torch.Tensor | None = None  # [B, Tr, K] int32 (any integer type), None = full vocabulary
    teacher_tail_logprob: torch.Tensor | None = None  # [B, Tr] log of the mass outside the top-K
    loss_temperature: float = 1.0

    def __post_init__(self) -> None:
        _check(self.teacher_log_probs.dim() == 2, "teacher_log_probs must be [B, Tr]")
        _check(self.teacher_log_probs.dtype == torch.float32, "teacher_log_probs must be float32")
        if self.teacher_topk_ids is not None:
            _check(self.teacher_topk_logprobs is not None, "teacher_topk_ids given without logprobs")
            _check(
                self.teacher_topk_ids.dtype in (torch.int32, torch.int64), "teacher_topk_ids must be int32 (or long)"
            )
            _check(
                self.teacher_topk_ids.shape == self.teacher_topk_logprobs.shape,
                "teacher_topk_ids and teacher_topk_logprobs must have the same [B, Tr, K] shape",
            )
        if self.teacher_topk_logprobs is not None:
            _check(
                self.teacher_topk_logprobs.shape[:2] == self.teacher_log_probs.shape,
                "teacher support must be [B, Tr, K] matching teacher_log_probs [B, Tr]",
            )

    def rows(self, start: int, stop: int) -> TeacherScores:
        """Rows [start, stop), not validated again (as RolloutBatch.rows)."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]

        return _unchecked(
            TeacherScores,
            teacher_log_probs=self.teacher_log_probs[start:stop],
            teacher_topk_logprobs=cut(self.teacher_topk_logprobs),
            teacher_topk_ids=cut(self.teacher_topk_ids),
            teacher_tail_logprob=cut(self.teacher_tail_logprob),
            loss_temperature=self.loss_temperature,
        )


def _unchecked(cls, **fields):
    """An instance of dataclass `cls` built without __post_init__: for slices of a validated instance."""
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def group_bounds(uid: list[str], parts: int) -> list[tuple[int, int]]:
    """Split rows into at most `parts` contiguous row ranges that never cut a uid group.

    Groups are dealt out as evenly as possible (the first ranges get one extra group); a range may be
    empty when there are fewer groups than parts.
    """
    starts = [i for i, u in enumerate(uid) if i == 0 or u != uid[i - 1]] + [len(uid)]
    groups = len(starts) - 1
    out, g = [], 0
    for p in range(parts):
        take = groups // parts + (1 if p < groups % parts else 0)
        out.append((starts[g], starts[g + take]))
        g += take
    return out


def concat_rollouts(batches: list[RolloutBatch]) -> RolloutBatch:
    """Stack batches from several rollout replicas, re-padding prompts (left) and responses (right)."""
    if not batches:
        raise BatchError("nothing to concatenate")
    versions = {b.policy_version for b in batches}
    if len(versions) != 1:
        raise PolicyMismatchError(f"rollout replicas returned samples of different policy versions {sorted(versions)}")
    tp = max(b.prompts.shape[1] for b in batches)
    tr = max(b.responses.shape[1] for b in batches)

    def pad(t: torch.Tensor, width: int, left: bool) -> torch.Tensor:
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra))

    teacher = {}
    if any(b.teacher_prompts is not None for b in batches):
        if not all(b.teacher_prompts is not None for b in batches):
            raise BatchError("some rollout replicas returned teacher prompts and some did not")
        tq = max(b.teacher_prompts.shape[1] for b in batches)
        teacher = {
            "teacher_prompts": torch.cat([pad(b.teacher_prompts, tq, True) for b in batches]),
            "teacher_prompt_mask": torch.cat([pad(b.teacher_prompt_mask, tq, True) for b in batches]),
        }

    return RolloutBatch(
        prompts=torch.cat([pad(b.prompts, tp, True) for b in batches]),
        prompt_mask=torch.cat([pad(b.prompt_mask, tp, True) for b in batches]),
        responses=torch.cat([pad(b.responses, tr, False) for b in batches]),
        response_mask=torch.cat([pad(b.response_mask, tr, False) for b in batches]),
        rollout_log_probs=torch.cat([pad(b.rollout_log_probs, tr, False) for b in batches]),
        uid=[u for b in batches for u in b.uid],
        ground_truth=[g for b in batches for g in b.ground_truth],
        policy_version=versions.pop(),
        finished=torch.cat([b.finished for b in batches]),
        data_source=[s for b in batches for s in b.data_source],
        extra_info=[e for b in batches for e in b.extra_info],
        **teacher,
    )


def concat_scores(parts: list[TeacherScores]) -> TeacherScores:
    """Stack scores of consecutive row ranges of one batch (same Tr and K in every part)."""

    def cat(name: str) -> torch.Tensor | None:
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts, dim=0)

    return TeacherScores(
        teacher_log_probs=cat("teacher_log_probs"),
        teacher_topk_logprobs=cat("teacher_topk_logprobs"),
        teacher_topk_ids=cat("teacher_topk_ids"),
        teacher_tail_logprob=cat("teacher_tail_logprob"),
        loss_temperature=parts[0].loss_temperature,
    )


def stack_rows(parts: list[TeacherScores], start: int, stop: int) -> TeacherScores:
    """Rows [start, stop) of the scores of consecutive row ranges `parts`, stacked (row 0 is the first part's first
    row): what a learner rank takes when its shard of the batch is not one scorer replica's part. Done in the
    learner, never in the driver: the parts hold the teacher's [B, Tr, K] support (step/controller.py)."""
    whole = parts[0] if len(parts) == 1 else concat_scores(parts)
    return whole.rows(start, stop)
