"""Summarize a strict and a one-step-stale run (lab/bench_staleness_cpu.sh) into
lab/results/staleness-cpu.json: eval reverse KL and accuracy, s/step, overlap, lag and ratio statistics.
MINIVERL_LOAD_LOG names an optional file of `epoch load1 load5 load15` lines sampled during the runs (the
machine is shared: the mean load says how much of the wall time was someone else's). MINIVERL_STALENESS_JSON
names another output file (a second seed's pair, say). Each run also reports what must be the same in both:
the optimizer updates applied, the evaluated steps, and the last checkpoint's Adam step counts and learning rate
(`same_schedule` compares them between the two runs)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path

STEP_KEYS = ("time/step", "time/refresh", "time/generate", "time/score", "time/update", "time/overlap")
LAG_KEYS = (
    "staleness",
    "sampler_gap_mean",
    "policy_drift_mean",
    "policy_drift_max",
    "clipped_ratio_frac",
    "ratio_mean",
)


def mean_load(log: Path | None, start: float, end: float) -> float | None:
    """Mean 1-minute load average over [start, end] from lines `epoch load1 load5 load15` (None: no log)."""
    if log is None or not log.exists():
        return None
    values = [
        float(p[1]) for p in (line.split() for line in log.read_text().splitlines()) if start <= float(p[0]) <= end
    ]
    return round(statistics.fmean(values), 2) if values else None


def optimizer_schedule(run: Path) -> dict:
    """The newest checkpoint's Adam step counts and learning rates (empty when the run saved none)."""
    checkpoints = sorted((run / "checkpoints").glob("step_*/optimizer.pt"))
    if not checkpoints:
        return {}
    import torch

    state = torch.load(checkpoints[-1], map_location="cpu")
    return {
        "optimizer_checkpoint": checkpoints[-1].parent.name,
        "optimizer_steps": sorted({int(s["step"]) for s in state["state"].values()}),
        "optimizer_lr": [g["lr"] for g in state["param_groups"]],
    }


def run_numbers(run: Path, wall: Path, load_log: Path | None = None) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r.get("step", 0) > 0 and "time/step" in r]
    start, end = map(float, wall.read_text().split())
    out = {
        "start_reverse_kl": summary["start_reverse_kl"],
        "end_reverse_kl": summary["end_reverse_kl"],
        "start_accuracy": summary["start_accuracy"],
        "end_accuracy": summary["end_accuracy"],
        "steps": len(steps),
        "command_seconds": round(end - start, 1),
        "mean_load_average_1min": mean_load(load_log, start, end),
        "train_wall_seconds": round(summary["wall_seconds"], 1),
        "eval": {r["step"]: r["eval/reverse_kl"] for r in lines if "eval/reverse_kl" in r},
        "updates": sum(1 for r in steps if not r.get("skipped_step")),
        "last_policy_version": steps[-1]["policy_version"] if steps else None,
        **optimizer_schedule(run),
    }
    for key in STEP_KEYS:
        values = [r[key] for r in steps[1:]]  # the first step builds caches and warms up
        out[f"median {key}"] = round(statistics.median(values), 4)
        out[f"sum {key}"] = round(sum(values), 1)
    for key in LAG_KEYS:
        values = [r[key] for r in steps[1:] if key in r]
        if values:
            out[f"mean {key}"] = statistics.fmean(values)
            out[f"max {key}"] = max(values)
    return out


def main(root: str, extra: str) -> None:
    base = Path(root)
    load_log = Path(os.environ["MINIVERL_LOAD_LOG"]) if "MINIVERL_LOAD_LOG" in os.environ else None
    strict = run_numbers(base / "staleness0", base / "staleness0.wall", load_log)
    stale = run_numbers(base / "staleness1", base / "staleness1.wall", load_log)
    ratio = stale["end_reverse_kl"] / strict["end_reverse_kl"]
    out = {
        "date": __import__("datetime").date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), shared with other work, no GPU",
        "command": f"bash lab/bench_staleness_cpu.sh {extra}".strip(),
        "runs": {"staleness=0": strict, "staleness=1": stale},
        "end_reverse_kl_stale_over_strict": ratio,
        "target": "end eval reverse KL of staleness=1 within 10% of staleness=0",
        "target_met": abs(ratio - 1.0) <= 0.10,
        "same_schedule": all(
            strict.get(k) == stale.get(k) for k in ("steps", "updates", "optimizer_steps", "optimizer_lr")
        )
        and list(strict["eval"]) == list(stale["eval"]),
    }
    path = Path(os.environ.get("MINIVERL_STALENESS_JSON", "lab/results/staleness-cpu.json"))
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
