"""Reverse-KL curves of `gkd` (beta = 1) and `pg_k1` on the embedded default, over the same steps.

    python lab/measurements/plot_kl_curves.py                                   # run both through Ray, then plot
    python lab/measurements/plot_kl_curves.py --gkd A/metrics.jsonl --pg-k1 B/metrics.jsonl  # finished runs
    python lab/measurements/plot_kl_curves.py -- trainer.total_steps=100        # extra overrides, both runs

Writes <out>.png (per-step reverse KL with eval points, and greedy accuracy at the eval points),
<out>.json (the numbers) and <out>.md (a short table), by default docs/figures/kl_curves.*.
Both curves use the controller's `reverse_kl`, the same k1 estimator for both objectives.
Needs matplotlib (`pip install -e .[plot]`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = {  # label -> Hydra overrides of `python -m miniverl.main`
    "gkd (beta=1)": ["+experiment=gkd", "objective.beta=1"],
    "pg_k1": ["+experiment=pg_k1"],
}
SMOOTH = 20  # steps in the moving average drawn over the raw per-step curve


def run(label: str, overrides: list[str], run_dir: Path) -> Path:
    """One training run through the normal entry point; returns its metrics.jsonl."""
    cmd = [sys.executable, "-m", "miniverl.main", *overrides, "tracking=disabled", f"hydra.run.dir={run_dir}"]
    print(f"[plot_kl_curves] {label}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return run_dir / "metrics.jsonl"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def moving_average(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def summarize(records: list[dict], metrics_file: Path) -> dict:
    steps = [r for r in records if "reverse_kl" in r]
    evals = [r for r in records if "eval/reverse_kl" in r]
    window = max(1, min(25, len(steps) // 4))
    head, tail = steps[:window], steps[-window:]
    summary_file = metrics_file.parent / "summary.json"
    wall = json.loads(summary_file.read_text()).get("wall_seconds") if summary_file.exists() else None
    return {
        "metrics_file": _rel(metrics_file),
        "steps": len(steps),
        "wall_seconds": wall,
        "eval_reverse_kl": {"start": evals[0]["eval/reverse_kl"], "end": evals[-1]["eval/reverse_kl"]},
        "eval_greedy_accuracy": {"start": evals[0]["eval/accuracy"], "end": evals[-1]["eval/accuracy"]},
        f"train_reverse_kl_first_{window}_steps": sum(r["reverse_kl"] for r in head) / len(head),
        f"train_reverse_kl_last_{window}_steps": sum(r["reverse_kl"] for r in tail) / len(tail),
        "eval_points": [
            {"step": r["step"], "reverse_kl": r["eval/reverse_kl"], "greedy_accuracy": r["eval/accuracy"]}
            for r in evals
        ],
    }


def plot(curves: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (label, records), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        steps = [r for r in records if "reverse_kl" in r]
        x, y = [r["step"] for r in steps], [r["reverse_kl"] for r in steps]
        ax_kl.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
        ax_kl.plot(x, moving_average(y, SMOOTH), color=color, label=f"{label}: per step ({SMOOTH}-step mean)")
        evals = [r for r in records if "eval/reverse_kl" in r]
        ex = [r["step"] for r in evals]
        ax_kl.plot(ex, [r["eval/reverse_kl"] for r in evals], "o--", color=color, label=f"{label}: eval")
        ax_acc.plot(ex, [r["eval/accuracy"] for r in evals], "o-", color=color, label=f"{label}: greedy (eval)")
        ax_acc.plot(x, moving_average([r["accuracy"] for r in steps], SMOOTH), color=color, alpha=0.5, linewidth=1)
    ax_kl.set(xlabel="step", ylabel="reverse KL to teacher (nats/token, k1)", title="Reverse KL(q || p)")
    ax_acc.set(xlabel="step", ylabel="exact-match accuracy", title="Accuracy (faint: sampled, training)")
    ax_acc.set_ylim(0, 1)
    for ax in (ax_kl, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def markdown(numbers: dict) -> str:
    lines = [
        "# Reverse KL: gkd (beta=1) vs pg_k1 on the embedded default",
        "",
        f"Produced by `python lab/measurements/plot_kl_curves.py` ({numbers['date']}, {numbers['machine']});"
        f" plot: `{numbers['png']}`.",
        "Runs: " + "; ".join(f"`python -m miniverl.main {' '.join(o)}`" for o in numbers["overrides"].values()) + ".",
        "Reverse KL is the controller's k1 estimate at temperature 1 (the same for both objectives); accuracy is",
        "greedy exact match on the 64 fixed eval prompts. pg_k1 samples n=4 per prompt, gkd n=2: see",
        "conf/experiment/pg_k1.yaml for why.",
        "",
        "| objective | steps | eval reverse KL start -> end | greedy accuracy start -> end | wall s |",
        "|---|---|---|---|---|",
    ]
    for label, s in numbers["runs"].items():
        kl, acc = s["eval_reverse_kl"], s["eval_greedy_accuracy"]
        wall = f"{s['wall_seconds']:.0f}" if s["wall_seconds"] is not None else "-"
        lines.append(
            f"| {label} | {s['steps']} | {kl['start']:.3f} -> {kl['end']:.3f} |"
            f" {acc['start']:.3f} -> {acc['end']:.3f} | {wall} |"
        )
    lines += ["", "Eval points (step: reverse KL / greedy accuracy):", ""]
    for label, s in numbers["runs"].items():
        points = ", ".join(f"{p['step']}: {p['reverse_kl']:.2f} / {p['greedy_accuracy']:.2f}" for p in s["eval_points"])
        lines.append(f"- {label}: {points}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gkd", type=Path, help="metrics.jsonl of a finished gkd (beta=1) run")
    parser.add_argument("--pg-k1", type=Path, help="metrics.jsonl of a finished pg_k1 run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/figures/kl_curves", help="output path without suffix")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "outputs/kl_curves", help="where new runs write")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs (after --)")
    args = parser.parse_args()

    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    given = {"gkd (beta=1)": args.gkd, "pg_k1": args.pg_k1}
    files = {}
    for label, overrides in RUNS.items():
        name = label.split()[0]
        files[label] = given[label] or run(label, overrides + args.overrides, args.runs_dir / stamp / name)
    curves = {label: load(path) for label, path in files.items()}
    png = args.out.with_suffix(".png")
    plot(curves, png)
    numbers = {
        "date": time.strftime("%Y-%m-%d"),
        "png": _rel(png),
        "machine": f"{os.cpu_count()} CPU cores, {'CUDA' if _cuda() else 'no GPU'}",
        "estimator": "controller reverse_kl: mean over sampled tokens of log q_sampler - log p_teacher",
        "overrides": {label: RUNS[label] + args.overrides for label in RUNS},
        "runs": {label: summarize(curves[label], path) for label, path in files.items()},
    }
    args.out.with_suffix(".json").write_text(json.dumps(numbers, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(numbers))
    print(markdown(numbers))


if __name__ == "__main__":
    main()
