"""Model references: a local directory (checked cheaply before any load) or a hub id (reachable, or cached).

No machine of this project reaches a hub, and Hugging Face's loaders retry an unreachable hub for about
a minute before failing. So a hub id is probed once with a short TCP connect; when the hub is out of
reach the locally cached snapshot is used, and without one the run stops at once saying to pass a
local directory.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from pathlib import Path
from urllib.parse import urlparse

from miniverl.errors import ConfigError
from miniverl.models.gguf import known_short_names

HUB_PROBE_TIMEOUT_S = 3.0  # a reachable hub answers a TCP connect in well under a second
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "owner/name"; dots allowed
SAFETENSORS_LEN_BYTES = 8  # a safetensors file starts with the little-endian u64 length of its JSON header
# What a load needs beside config.json. A tokenizer is one of these files (or a sentencepiece `*.model`) plus its
# config; the weights are safetensors or torch files, or an index of their shards.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
TOKENIZER_CONFIG = "tokenizer_config.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
CONFIG_FILES = ("config.json", "generation_config.json")  # a directory of these alone has no model to load


def resolve_model_ref(path: str, field: str, fix: str, loads: bool = True) -> str:
    """A loadable reference for `path`: the directory itself, the hub id, or the cached snapshot dir.

    `fix` says what to do when a local model is broken (re-save it, or rebuild a built-in cache); `loads`: False
    where only config.json is read (check_model_dir). GGUF files and short names are resolved before this
    (miniverl/models/gguf.py).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        check_model_dir(p, field, fix, loads)
        return str(p)
    if p.exists():
        raise ConfigError(
            f"{field}={path!r} is a file, not a model directory; pass the directory that holds its config.json and"
            " weights (the folder save_pretrained wrote), a .gguf file, a hub id, or builtin:student / builtin:teacher"
        )
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or not HUB_ID.match(path)
    if looks_local:
        raise ConfigError(
            f"{field}={path!r} does not exist; pass a saved model directory, a .gguf file, a hub id such as"
            f" Qwen/Qwen2.5-0.5B-Instruct, a shipped model's short name ({known_short_names()}), or builtin:student /"
            " builtin:teacher"
        )
    reason = hub_unreachable_reason()
    if reason is None:
        return path
    cached = cached_snapshot(path)
    if cached is not None:
        return cached
    short = "" if "/" in path else f", or name a shipped model by its short name ({known_short_names()})"
    raise ConfigError(
        f"{field}={path!r} is a hub id, but the hub is unreachable ({reason}) and the model is not in the local"
        f" Hugging Face cache; download it where the hub is reachable (hf download {path} --local-dir DIR;"
        f" older huggingface-hub: huggingface-cli download) and pass {field}=DIR{short}"
    )


def hub_unreachable_reason() -> str | None:
    """None when the hub answers a TCP connect; else why not (offline mode, DNS, refused, timeout)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S):
            return None
    except OSError as e:
        return f"{url.hostname}:{port}: {e.__class__.__name__}: {e}"


def cached_snapshot(repo_id: str) -> str | None:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached (the library raises several kinds); the caller reports it
        return None


def check_model_dir(p: Path, field: str, fix: str, loads: bool = True) -> None:
    """config.json readable, every safetensors file as long as its header says and, where a run `loads` the model
    (not the fit planner, which reads config.json alone), the weights and tokenizer files present: before any load."""
    config = p / "config.json"
    ggufs = sorted(p.glob("*.gguf"))
    if not config.exists() and ggufs:
        raise ConfigError(
            f"{field}={str(p)!r} is a directory without config.json; for its GGUF file pass the file itself"
            f" ({field}={ggufs[0]})"
        )
    if not config.exists():
        raise ConfigError(
            f"{field}={str(p)!r} is a directory without config.json; point it at a saved Hugging Face model"
            " (the folder save_pretrained wrote)"
        )
    try:
        json.loads(config.read_text())
    except (ValueError, OSError) as e:
        raise ConfigError(f"{field}={str(p)!r}: config.json is unreadable ({e.__class__.__name__}: {e}); {fix}") from e
    for weights in sorted(p.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise ConfigError(f"{field}={str(p)!r}: {weights.name} {problem}; {fix}")
    missing = missing_for_load(p) if loads else []
    if missing:
        # Without this a directory missing its tokenizer failed far downstream ("vocabulary differs (43 vs 1
        # tokens)", "prompt 0 has no tokens"): transformers falls back to whatever it can build from config.json.
        alone = all(f.name in CONFIG_FILES for f in p.iterdir())
        raise ConfigError(
            f"{field}={str(p)!r} {'holds only config.json' if alone else 'cannot load'}: {'; '.join(missing)}; {fix}"
        )


def missing_for_load(p: Path) -> list[str]:
    """What a model directory lacks that loading the model and its tokenizer needs, one phrase each; [] when
    nothing. Files may be symlinks (a hub snapshot's point into its blobs)."""
    missing = []
    if not any((p / name).exists() for name in TOKENIZER_VOCAB_FILES) and not any(p.glob("*.model")):
        missing.append(
            "no tokenizer files (tokenizer.json, or a vocabulary: tokenizer.model, vocab.json with merges.txt,"
            " vocab.txt)"
        )
    if not (p / TOKENIZER_CONFIG).exists():
        missing.append(f"no {TOKENIZER_CONFIG} (the tokenizer's special tokens and chat template)")
    indexes = sorted(p.glob("*.index.json"))
    if not indexes and not any(any(p.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        missing.append("no weights (*.safetensors, pytorch_model.bin, or an index of shards)")
    for index in indexes:
        shards = sorted(set(index_shards(index)))
        absent = [s for s in shards if not (p / s).exists()]
        if absent:
            missing.append(f"{index.name} names {len(absent)} shard(s) that are not there ({', '.join(absent[:3])})")
    return missing


def index_shards(index: Path) -> list[str]:
    """The shard files a weights index (model.safetensors.index.json) maps tensors to; [] when unreadable (the
    load then reports it)."""
    try:
        return [str(f) for f in json.loads(index.read_text()).get("weight_map", {}).values()]
    except (ValueError, OSError, AttributeError):
        return []


def safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file cannot load (truncated, corrupt header), or None. Reads only the header."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(SAFETENSORS_LEN_BYTES)
        if len(head) < SAFETENSORS_LEN_BYTES:
            return f"is truncated ({size} bytes, no header)"
        (header_len,) = struct.unpack("<Q", head)
        if SAFETENSORS_LEN_BYTES + header_len > size:
            return f"is truncated ({size} bytes, shorter than its {header_len}-byte header)"
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            return f"has a corrupt header ({e})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    expected = SAFETENSORS_LEN_BYTES + header_len + end
    return None if size >= expected else f"is truncated ({size} of {expected} bytes)"
