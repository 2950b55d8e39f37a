"""Whether a checkpoint can continue under the current config, and what changed.

A resumed run starts from the saved run's config and applies only what the command line sets now
(`resumed_config`), so a difference is always something the user asked for. A config key falls in one
of four classes:
- the LoRA shape: refused, the adapter and its optimizer state would not fit.
- guarded: what is trained on and toward what (models, objective, data, reward, sampling: rollout.*).
  Refused unless trainer.resume_allow_changes=true, then allowed with a warning.
- harmless: how long, how often to evaluate/save/log, where actors run. Said, then allowed.
- everything else (learning rate, micro-batch, ...): allowed and said, with the warning that the run no
  longer matches the uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from miniverl.errors import ConfigError

IDENTITY_PREFIXES = (
    "model.student.",
    "model.teacher.",
    "model.teachers.",  # several teachers: which ones, and which rows each scores
    "model.teacher_by_source.",
    "model.default_teacher",
    "model.lora.",
    "objective.",
)
FIXED_PREFIXES = ("model.lora.",)
GUARDED_PREFIXES = (
    "model.student.",
    "model.teacher.",
    "model.teachers.",
    "model.teacher_by_source.",
    "model.default_teacher",
    "objective.",
    "data.",
    "reward.",
    "rollout.",
    "trainer.loss_weight_by_source",  # how much each source's rows count in the loss
)
ALLOW_CHANGES = "trainer.resume_allow_changes"
HARMLESS_PREFIXES = (
    "trainer.total_steps",
    "trainer.eval_every",
    "trainer.eval_samples",
    "trainer.save_every",
    "trainer.keep_checkpoints",
    "trainer.resume",  # also trainer.resume_allow_changes
    "trainer.on_nonfinite",
    "trainer.probe_every",  # how often strict sync also probes: every refresh is proven either way
    "tracking.",
    "resources.",
    "model.cache_dir",
)
SHOWN_DIFFERENCES = 5  # keys quoted in a message; the rest are counted


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def identity_hash(config: dict[str, Any]) -> str:
    """SHA-256 of the identity keys: equal hashes mean the checkpoint fits this config."""
    flat = flatten(config)
    keep = {k: v for k, v in flat.items() if k.startswith(IDENTITY_PREFIXES)}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()


def _describe(keys: list[str], old: dict, new: dict) -> str:
    shown = [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in keys[:SHOWN_DIFFERENCES]]
    more = f" and {len(keys) - SHOWN_DIFFERENCES} more" if len(keys) > SHOWN_DIFFERENCES else ""
    return "; ".join(shown) + more


def check_resumable(saved: dict[str, Any], current: dict[str, Any], where: str) -> list[str]:
    """Raise ConfigError when `saved` (the checkpoint's config) cannot continue under `current`;
    otherwise return one message per class of allowed difference (empty when the configs are equal)."""
    old, new = flatten(saved), flatten(current)
    # A key the checkpoint's config lacks came with a newer miniverl; the saved run ran without it.
    changed = sorted(k for k in old if old[k] != new.get(k))
    fixed = [k for k in changed if k.startswith(FIXED_PREFIXES)]
    if fixed:
        raise ConfigError(
            f"checkpoint {where} was made under another LoRA shape ({_describe(fixed, old, new)}): its adapter"
            " and optimizer state do not fit; resume it with its own settings, or start a fresh run"
            " (trainer.resume=none in a new run directory)"
        )
    # A `.name` first: another objective brings its whole own settings, and its name says the most.
    guarded = sorted((k for k in changed if k.startswith(GUARDED_PREFIXES)), key=lambda k: not k.endswith(".name"))
    if guarded and not new.get(ALLOW_CHANGES):
        raise ConfigError(
            f"resuming checkpoint {where} with another model, objective, data, reward or sampling"
            f" ({_describe(guarded, old, new)}): the resumed run would train something else than the run it"
            f" continues. Drop those overrides to continue it as it was, add {ALLOW_CHANGES}=true to change them"
            " anyway, or start a fresh run (trainer.resume=none in a new run directory)"
        )
    harmless = [k for k in changed if k.startswith(HARMLESS_PREFIXES)]
    other = [k for k in changed if k not in harmless]
    notes = []
    if harmless:
        notes.append(f"resuming with changed run settings (harmless): {_describe(harmless, old, new)}")
    if other:
        notes.append(
            f"resuming with changed training settings ({_describe(other, old, new)}): the run continues, but no"
            " longer matches an uninterrupted run"
        )
    return notes


def command_line_keys(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(config keys set as key=value, config-group choices) among Hydra's command-line overrides.

    `data.train_files=[a]` and `+reward.by_source={...}` set keys; `+experiment=gkd`, `rollout=vllm` and
    `model/student=builtin` choose config groups (no dot, or a slash). `hydra.*` is left out.
    """
    keys, groups = [], []
    for override in overrides:
        name = override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        if name == "hydra" or name.startswith("hydra."):
            continue
        if "." in name and "/" not in name:
            keys.append(name)
        else:
            groups.append(override)
    return keys, groups
