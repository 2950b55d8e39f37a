"""PNG curves of a finished run, drawn from metrics.jsonl, so a user without wandb still sees them.

matplotlib is a dependency; in an environment without it the run says how to install it and writes no PNGs.
"""

from __future__ import annotations

import json
from pathlib import Path

PHASES = ("refresh", "generate", "score", "update")
FIGURE_SIZE = (6.0, 4.0)  # inches; 100 dpi gives 600x400 PNGs
MISSING_MATPLOTLIB = (
    "[miniverl] no PNG plots: matplotlib is not installed (pip install matplotlib), or set tracking.plots=false"
)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def write_plots(metrics_path: Path, out_dir: Path, log=print) -> list[Path]:
    """reverse_kl.png, accuracy.png and step_time.png in `out_dir`; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        log(MISSING_MATPLOTLIB)
        return []
    records = read_metrics(metrics_path)
    written = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    for name, title, keys in (
        ("reverse_kl.png", "reverse KL to the teacher (nats/token)", ("reverse_kl", "eval/reverse_kl")),
        ("accuracy.png", "task accuracy", ("accuracy", "eval/accuracy")),
    ):
        fig, ax = plt.subplots(figsize=FIGURE_SIZE)
        for key in keys:
            steps, values = _series(records, key)
            ax.plot(steps, values, marker="o" if key.startswith("eval/") else None, label=key)
        ax.set(title=title, xlabel="step")
        ax.legend()
        save(fig, name)
    fig, ax = plt.subplots(figsize=FIGURE_SIZE)
    steps, _ = _series(records, "time/step")
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        _, values = _series(records, f"time/{phase}")
        if len(values) == len(steps):
            ax.bar(steps, values, bottom=bottom, width=1.0, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="step time by phase (s)", xlabel="step", ylabel="seconds")
    ax.legend()
    save(fig, "step_time.png")
    return written
