"""Whether a checkpoint can continue under the current config, and what changed.

A config key falls in one of three classes:
- identity: what is trained and how (the models, the LoRA shape, the objective). A checkpoint made under
  another identity cannot continue: the adapter or optimizer would not fit, or would mean something else.
- harmless: how long, how often to evaluate/save/log, where actors run. Said, then allowed.
- everything else (learning rate, data, sampling): allowed and said, with the warning that the run no
  longer matches the uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from miniverl.protocol import ConfigError

IDENTITY_PREFIXES = ("model.student.", "model.teacher.", "model.lora.", "objective.")
HARMLESS_PREFIXES = (
    "trainer.total_steps",
    "trainer.eval_every",
    "trainer.eval_samples",
    "trainer.save_every",
    "trainer.keep_checkpoints",
    "trainer.resume",
    "trainer.on_nonfinite",
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
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    # A `.name` first: another objective brings its whole own settings, and its name says the most.
    identity = sorted((k for k in changed if k.startswith(IDENTITY_PREFIXES)), key=lambda k: not k.endswith(".name"))
    if identity:
        raise ConfigError(
            f"checkpoint {where} was made under another model, LoRA shape or objective"
            f" ({_describe(identity, old, new)}); resume it with its own settings, or start a fresh run"
            " (trainer.resume=none in a new run directory)"
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
