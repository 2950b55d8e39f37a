"""Write a bench's results: `<output_dir>/<name>.json` (everything) and `<name>.md` (the table people read).

Both carry the command, machine, versions and date. An invalid cell shows what was measured and why it
does not count; a cell not run says why; no number is ever replaced by zero.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("torch", "transformers", "peft", "hydra-core", "omegaconf", "vllm")


def write_report(cfg, command: str, results: list, build_s: float, total_s: float) -> tuple[Path, Path]:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dataclasses.asdict(cfg)
    cells = [_cell_dict(r, results, cfg) for r in results]
    doc = {
        "bench": cfg.name,
        "description": cfg.description,
        "command": command,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "versions": versions(),
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "config": config,
        "model_build_s": build_s,
        "total_s": total_s,
        "cells": cells,
        "targets": targets(cfg, cells),
    }
    json_path, md_path = out / f"{cfg.name}.json", out / f"{cfg.name}.md"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    md_path.write_text(markdown(doc))
    return json_path, md_path


def _cell_dict(r, results: list, cfg) -> dict:
    d = {k: v for k, v in dataclasses.asdict(r).items() if k != "completions"}
    d["rows"] = r.rows
    d["median_tokens_per_s"] = statistics.median(r.tokens_per_s) if r.tokens_per_s else None
    d["median_wall_s"] = statistics.median(r.wall_s) if r.wall_s else None
    d["speedup"], d["speedup_note"] = speedup(r, results, cfg)
    return d


def speedup(r, results: list, cfg) -> tuple[float | None, str]:
    """Median tokens/s over the baseline's in the same cell. When the baseline hit its time cap, its
    tokens/s was below rows x length / cap, which bounds the speedup from below."""
    if r.label == cfg.baseline or r.status != "valid":
        return None, ""
    base = next(
        b
        for b in results
        if b.label == cfg.baseline and (b.length, b.prompts, b.samples) == (r.length, r.prompts, r.samples)
    )
    mine = statistics.median(r.tokens_per_s)
    if base.status in ("valid", "unjudged") and base.tokens_per_s:  # unjudged: a speed-only baseline
        return mine / statistics.median(base.tokens_per_s), ""
    if any(reason.startswith("time cap") for reason in base.reasons):
        cap = cfg.backends[cfg.baseline].time_cap_s
        return mine * cap / (r.rows * r.length), "lower bound: the baseline hit its time cap"
    return None, f"baseline {base.status}"


def targets(cfg, cells: list[dict]) -> list[dict]:
    rows = []
    for label, minimum in cfg.targets.items():
        for c in (c for c in cells if c["label"] == label):
            s = c["speedup"]
            if s is None:
                verdict = "not evaluable"
            elif s >= minimum:
                verdict = "met"
            else:
                verdict = "not shown" if c["speedup_note"] else "missed"  # a lower bound below target proves nothing
            rows.append({k: c[k] for k in ("label", "length", "prompts", "samples", "speedup", "speedup_note")})
            rows[-1].update(target=minimum, verdict=verdict, status=c["status"])
    return rows


def machine() -> dict:
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["miniverl_commit"] = _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    found["miniverl_tree"] = None if status is None else ("clean" if not status else "uncommitted changes")
    return found


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown(doc: dict) -> str:
    m, v = doc["machine"], doc["versions"]
    gpu = f"{m['gpu']} ({m['gpu_memory_gib']} GiB), CUDA {m['cuda']}" if "gpu" in m else "no GPU"
    lines = [
        f"# Benchmark `{doc['bench']}`",
        "",
        doc["description"].strip(),
        "",
        f"- Command: `{doc['command']}`",
        f"- Date: {doc['date_utc']}; total {doc['total_s']:.0f} s (model build {doc['model_build_s']:.1f} s)",
        f"- Machine: {gpu}; {m['cpu_count']} CPUs; {m['platform']}; Python {m['python']}",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None),
        f"- Preregistration: `lab/conf/bench/{doc['bench']}.yaml` (resolved config sha256 {doc['config_sha256'][:16]})",
        "",
        "| backend | tokens | prompts x n | status | tokens/s (median) | wall s (median) | spread | speedup |"
        " peak alloc / reserved GiB | device used GiB | oracle gap mean / p99 | same seqs as baseline | decode |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in doc["cells"]:
        status = c["status"] if not c["reasons"] else f"{c['status']}: {'; '.join(c['reasons'])}"
        if c["status"] == "pending":  # only in a report of a run that was stopped
            measured = "measured, not judged" if c["tokens_per_s"] else "not reached"
            status = f"pending: {measured} (the run stopped before the oracle check)"
        mem = c["memory"]
        s = c["speedup"]
        speed = "—" if s is None else (f"> {s:.1f}x" if c["speedup_note"] else f"{s:.2f}x")
        lines.append(
            f"| {c['label']} | {c['length']} | {c['prompts']} x {c['samples']} | {status} |"
            f" {_num(c['median_tokens_per_s'], ',.0f')} | {_num(c['median_wall_s'], '.2f')} |"
            f" {_num(c['spread'], '.1%')} | {speed} |"
            f" {_num(mem.get('peak_allocated_gib'), '.2f')} / {_num(mem.get('peak_reserved_gib'), '.2f')} |"
            f" {_num(mem.get('device_used_gib'), '.2f')} |"
            f" {_num(c['oracle'].get('gap_mean'), '.2g')} / {_num(c['oracle'].get('gap_p99'), '.2g')} |"
            f" {_num(c['identical_to_baseline'], '.0%')} | {c['decode_mode'] or '—'} |"
        )
    if doc["targets"]:
        lines += [
            "",
            "## Targets",
            "",
            "| backend | tokens | prompts x n | speedup | target | verdict |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for t in doc["targets"]:
            s = (
                "—"
                if t["speedup"] is None
                else (f"> {t['speedup']:.1f}x" if t["speedup_note"] else f"{t['speedup']:.2f}x")
            )
            lines.append(
                f"| {t['label']} | {t['length']} | {t['prompts']} x {t['samples']} | {s} | {t['target']:g}x |"
                f" {t['verdict']} ({t['status']}) |"
            )
    lines += [
        "",
        "Tokens/s: tokens generated by all rows / wall time of one `generate` call (prefill included), median",
        "over the timed repeats. Speedup: over the baseline's median in the same cell. Invalid cells keep their",
        "measured numbers for the record; they do not count. `—`: not measured.",
        "",
    ]
    return "\n".join(lines)
