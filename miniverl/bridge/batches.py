"""Rollout/training batches as safetensors + a JSON manifest, under verl's key names and padding.

Layout of a batch directory:
    batch.safetensors   tensors keyed by verl's names (below) plus `miniverl_*` extras verl has no name for
    manifest.json       format, miniverl and target verl versions, policy version, every tensor's dtype and
                        shape, the non-tensor columns (uid, ground_truth) and the padding sides

verl keys (DESIGN.md "Batch keys"): prompts [B, Tp] left-padded, responses [B, Tr] right-padded,
response_mask [B, Tr] (1 = sampled token, EOS kept), input_ids / attention_mask / position_ids [B, Tp+Tr],
rollout_log_probs [B, Tr], teacher_logprobs [B, Tr, K] with teacher_ids [B, Tr, K] for a top-K support or
[B, Tr, 1] (the sampled token) without one, token_level_scores / token_level_rewards [B, Tr] (the reward on
the last response token), advantages, old_log_probs, ref_log_prob [B, Tr]. No pickle anywhere: the files
are plain tensors and JSON.

This module imports only torch and safetensors, so the verl virtualenv can read batches with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miniverl.atomic import atomic_dir
from miniverl.batches import RolloutBatch, TeacherScores
from miniverl.bridge.versions import DEFAULT_VERL_VERSION, major, miniverl_version
from miniverl.errors import BatchError, ConfigError

FORMAT = "miniverl-verl-batch"
TENSORS_FILE = "batch.safetensors"
MANIFEST_FILE = "manifest.json"
# Optional per-token columns a training batch may carry, under verl's names. Shapes: each [B, Tr].
OPTIONAL_TOKEN_KEYS = ("advantages", "old_log_probs", "ref_log_prob")
# miniVERL fields verl has no key for, kept so that a batch reads back exactly.
EXTRA_FINISHED = "miniverl_finished"  # [B] bool: the row ended with a stop token
EXTRA_TEACHER_SAMPLED = "miniverl_teacher_log_probs"  # [B, Tr]: teacher log p of the sampled token
EXTRA_TEACHER_TAIL = "miniverl_teacher_tail_logprob"  # [B, Tr]: log-mass outside the top-K
EXTRA_TEACHER_FULL = "miniverl_teacher_full_logprobs"  # [B, Tr, V]: a full-vocabulary support


@dataclass
class ExportedBatch:
    """What a batch directory holds, read back: miniVERL's typed batches plus the optional columns."""

    rollout: RolloutBatch
    scores: TeacherScores | None
    rewards: torch.Tensor | None  # [B] sequence scores
    columns: dict[str, torch.Tensor] = field(default_factory=dict)  # OPTIONAL_TOKEN_KEYS present, [B, Tr]
    manifest: dict = field(default_factory=dict)


def refuse_existing(out: str | Path) -> None:
    """The bridge never writes over something already there (it would lose it)."""
    if Path(out).exists():
        raise ConfigError(f"{out} already exists; the bridge never overwrites: pass a new --out or remove it first")


def last_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's token_level_scores: each row's sequence reward on its last response token, 0 elsewhere.

    Shapes: rewards [B], response_mask [B, Tr] -> [B, Tr].
    """
    lengths = response_mask.long().sum(dim=1)  # [B]
    if bool((lengths == 0).any()):
        raise BatchError("a row has no response token, so its reward has nowhere to sit; drop empty responses")
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    out[torch.arange(len(lengths)), lengths - 1] = rewards.float()
    return out


def batch_tensors(
    batch: RolloutBatch,
    scores: TeacherScores | None = None,
    rewards: torch.Tensor | None = None,
    columns: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The batch under verl's key names (and miniverl_* extras), all CPU tensors."""
    t = {
        "prompts": batch.prompts,
        "responses": batch.responses,
        "response_mask": batch.response_mask,
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "rollout_log_probs": batch.rollout_log_probs,
        EXTRA_FINISHED: batch.finished,
    }
    if scores is not None:
        if scores.teacher_topk_ids is not None:
            t["teacher_logprobs"] = scores.teacher_topk_logprobs  # [B, Tr, K]
            t["teacher_ids"] = scores.teacher_topk_ids  # [B, Tr, K]
            t[EXTRA_TEACHER_SAMPLED] = scores.teacher_log_probs
            if scores.teacher_tail_logprob is not None:
                t[EXTRA_TEACHER_TAIL] = scores.teacher_tail_logprob
        else:
            t["teacher_logprobs"] = scores.teacher_log_probs.unsqueeze(-1)  # [B, Tr, 1], verl's estimator input
            if scores.teacher_topk_logprobs is not None:
                t[EXTRA_TEACHER_FULL] = scores.teacher_topk_logprobs
    if rewards is not None:
        if rewards.shape != (len(batch),):
            raise BatchError(f"rewards must be [B]={len(batch)} sequence scores; got {tuple(rewards.shape)}")
        t["token_level_scores"] = last_token_rewards(rewards, batch.response_mask)
        t["token_level_rewards"] = t["token_level_scores"].clone()  # no in-reward KL: rewards = scores
    for key, value in (columns or {}).items():
        if key not in OPTIONAL_TOKEN_KEYS:
            raise BatchError(f"unknown batch column {key!r}; known: {', '.join(OPTIONAL_TOKEN_KEYS)}")
        if value.shape != batch.responses.shape:
            raise BatchError(f"{key} must be [B, Tr]={tuple(batch.responses.shape)}; got {tuple(value.shape)}")
        t[key] = value
    return {k: v.detach().to("cpu").contiguous() for k, v in t.items()}


def save_batch(
    out: str | Path,
    batch: RolloutBatch,
    scores: TeacherScores | None = None,
    rewards: torch.Tensor | None = None,
    columns: dict[str, torch.Tensor] | None = None,
    verl_version: str = DEFAULT_VERL_VERSION,
) -> Path:
    """Write the batch to the new directory `out` (atomically; an existing `out` is refused)."""
    from safetensors.torch import save_file

    tensors = batch_tensors(batch, scores, rewards, columns)
    manifest = {
        "format": FORMAT,
        "miniverl_version": miniverl_version(),
        "verl_version": verl_version,
        "policy_version": batch.policy_version,
        "loss_temperature": None if scores is None else scores.loss_temperature,
        "padding": {"prompts": "left", "responses": "right"},
        "tensors": {
            k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in tensors.items()
        },
        "non_tensors": {"uid": list(batch.uid), "ground_truth": list(batch.ground_truth)},
    }
    refuse_existing(out)
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / TENSORS_FILE))
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return Path(out)


def read_manifest(path: str | Path) -> dict:
    """The manifest of batch directory `path`, refused when another miniverl major version wrote it."""
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        raise BatchError(f"{path} has no {MANIFEST_FILE}; pass a directory written by save_batch")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT:
        raise BatchError(f"{file}: format {manifest.get('format')!r} is not {FORMAT!r}")
    theirs, ours = manifest.get("miniverl_version", "?"), miniverl_version()
    if major(theirs) != major(ours):
        raise BatchError(
            f"{file} was written by miniverl {theirs}, this is miniverl {ours}: batch layouts may differ across"
            f" major versions; re-export the batch with miniverl {major(ours)}.x"
        )
    return manifest


def load_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and manifest of a batch directory, each tensor checked against the manifest's dtype and shape."""
    from safetensors.torch import load_file

    manifest = read_manifest(path)
    tensors = load_file(str(Path(path) / TENSORS_FILE))
    declared = manifest["tensors"]
    if set(declared) != set(tensors):
        raise BatchError(f"{path}: manifest lists {sorted(declared)}, the file holds {sorted(tensors)}")
    for key, spec in declared.items():
        got = {"dtype": str(tensors[key].dtype).removeprefix("torch."), "shape": list(tensors[key].shape)}
        if got != spec:
            raise BatchError(f"{path}: tensor {key} is {got}, the manifest says {spec}")
    return tensors, manifest


def load_batch(path: str | Path) -> ExportedBatch:
    """Read a batch directory back into miniVERL's typed batches (validated on construction)."""
    t, manifest = load_tensors(path)
    tp = t["prompts"].shape[1]
    rollout = RolloutBatch(
        prompts=t["prompts"],
        prompt_mask=t["attention_mask"][:, :tp],
        responses=t["responses"],
        response_mask=t["response_mask"],
        rollout_log_probs=t["rollout_log_probs"],
        uid=manifest["non_tensors"]["uid"],
        ground_truth=manifest["non_tensors"]["ground_truth"],
        policy_version=manifest["policy_version"],
        finished=t[EXTRA_FINISHED],
    )
    scores = None
    if "teacher_ids" in t:
        scores = TeacherScores(
            t[EXTRA_TEACHER_SAMPLED],
            t["teacher_logprobs"],
            t["teacher_ids"],
            t.get(EXTRA_TEACHER_TAIL),
            manifest["loss_temperature"],
        )
    elif "teacher_logprobs" in t:
        scores = TeacherScores(
            t["teacher_logprobs"].squeeze(-1), t.get(EXTRA_TEACHER_FULL), None, None, manifest["loss_temperature"]
        )
    rewards = t["token_level_scores"].sum(dim=1) if "token_level_scores" in t else None
    columns = {k: t[k] for k in OPTIONAL_TOKEN_KEYS if k in t}
    return ExportedBatch(rollout, scores, rewards, columns, manifest)


def to_dataproto(path: str | Path):
    """A `verl.protocol.DataProto` of a batch directory (needs verl importable: the verl virtualenv)."""
    import numpy as np

    try:
        from verl import DataProto
    except ImportError as e:
        raise ImportError(
            "verl is not importable here; run this in the verl virtualenv (scripts/make_verl_venv.sh)"
        ) from e
    tensors, manifest = load_tensors(path)
    non_tensors = {k: np.array(v, dtype=object) for k, v in manifest["non_tensors"].items()}
    meta = {k: manifest[k] for k in ("policy_version", "miniverl_version", "verl_version", "loss_temperature")}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
