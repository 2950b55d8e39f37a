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

HUB_PROBE_TIMEOUT_S = 3.0  # a reachable hub answers a TCP connect in well under a second
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "owner/name"; dots allowed
SAFETENSORS_LEN_BYTES = 8  # a safetensors file starts with the little-endian u64 length of its JSON header


def resolve_model_ref(path: str, field: str, fix: str) -> str:
    """A loadable reference for `path`: the directory itself, the hub id, or the cached snapshot dir.

    `fix` says what to do when a local model is broken (re-save it, or rebuild a built-in cache).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        check_model_dir(p, field, fix)
        return str(p)
    if p.exists():
        raise ConfigError(
            f"{field}={path!r} is a file, not a model directory; pass the directory that holds its config.json and"
            " weights (the folder save_pretrained wrote), a hub id, or builtin:student / builtin:teacher"
        )
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or not HUB_ID.match(path)
    if looks_local:
        raise ConfigError(
            f"{field}={path!r} does not exist; pass a saved model directory, a hub id such as"
            f" Qwen/Qwen2.5-0.5B-Instruct, or builtin:student / builtin:teacher"
        )
    reason = hub_unreachable_reason()
    if reason is None:
        return path
    cached = cached_snapshot(path)
    if cached is not None:
        return cached
    raise ConfigError(
        f"{field}={path!r} is a hub id, but the hub is unreachable ({reason}) and the model is not in the local"
        f" Hugging Face cache; download it where the hub is reachable (hf download {path} --local-dir DIR;"
        f" older huggingface-hub: huggingface-cli download) and pass {field}=DIR"
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


def check_model_dir(p: Path, field: str, fix: str) -> None:
    """config.json readable and every safetensors file as long as its header says, before any load."""
    config = p / "config.json"
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
