"""Run tracking: metrics.jsonl (one line per step), wandb (offline by default), a progress bar, and the run's state
on the Ray dashboard: gauges recorded through `ray.util.metrics` after every step.

Ray exports the gauges to Prometheus (the dashboard's Metrics tab shows them when Prometheus/Grafana are set up:
docs/objectives.md, "Metrics every step"). Their names start with `miniverl_`; phases and actors are tags, so one
panel shows all.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miniverl.atomic import atomic_write_text

PROGRESS_KEYS = ("reverse_kl", "accuracy", "loss", "time/step")  # shown on the progress bar
REPLACED_SUFFIX = ".replaced.jsonl"  # <name>.replaced.jsonl: lines of steps a resumed run did again
REPLACED_METRICS = "metrics" + REPLACED_SUFFIX


class Tracker:
    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        wandb_mode: str,
        project: str,
        run_name: str | None,
        total_steps: int,
        progress_bar: bool,
        initial_step: int = 0,
    ) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self._file = self.metrics_path.open("a")
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=project,
                name=run_name,
                mode=wandb_mode,
                dir=str(run_dir),
                config=config,
                settings=wandb.Settings(console="off"),
            )
        self._bar = None
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc="miniverl", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._bar is not None:
            self._bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in PROGRESS_KEYS if k in metrics})
            if advance:
                self._bar.update(1)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Evaluation sample rows: appended to samples.jsonl (one line each, with the step), and a wandb table."""
        if not rows:
            return
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        if self._wandb is not None:
            import wandb

            columns = ["step", *rows[0]]
            table = wandb.Table(columns=columns, data=[[step, *r.values()] for r in rows])
            self._wandb.log({"eval/samples": table}, step=step)

    def write(self, line: str) -> None:
        """Print without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float)})
            self._wandb.finish()
        self._file.close()


def trim_metrics(path: Path, last_step: int) -> list[dict[str, Any]]:
    """Keep the lines of steps <= last_step (a resumed run redoes the later ones) and return them.

    The later lines are not lost: they are appended to <name>.replaced.jsonl next to the file (for
    metrics.jsonl and samples.jsonl, whose lines both carry their step).
    """
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]
    keep = [line for line, r in zip(lines, records) if r["step"] <= last_step]
    drop = [line for line, r in zip(lines, records) if r["step"] > last_step]
    if drop:
        with path.with_name(path.stem + REPLACED_SUFFIX).open("a") as f:
            f.write("\n".join(drop) + "\n")
    atomic_write_text(path, "".join(line + "\n" for line in keep))  # a crash leaves the old file
    return [r for r in records if r["step"] <= last_step]


PHASES = ("refresh", "generate", "score", "update")
# gauge name -> (description, metrics key of the step)
STEP_GAUGES = {
    "miniverl_step": ("steps completed", "step"),
    "miniverl_step_seconds": ("wall time of the last step (s)", "time/step"),
    "miniverl_rollout_tokens_per_s": ("sampled response tokens per second of generation", "rollout_tokens_per_s"),
    "miniverl_reverse_kl": ("k1 reverse KL to the teacher on the last step's samples (nats/token)", "reverse_kl"),
    "miniverl_accuracy": ("task accuracy of the last step's samples", "accuracy"),
    "miniverl_eval_reverse_kl": ("reverse KL on the eval prompts (nats/token)", "eval/reverse_kl"),
    "miniverl_eval_accuracy": ("greedy accuracy on the eval prompts", "eval/accuracy"),
}


class RunGauges:
    """Holds the gauges; `gauge(name, description, tag_keys)` makes one (ray.util.metrics.Gauge by default)."""

    def __init__(self, gauge: Callable[..., Any] | None = None) -> None:
        if gauge is None:
            from ray.util.metrics import Gauge as gauge
        self.step = {name: gauge(name, description=desc) for name, (desc, _) in STEP_GAUGES.items()}
        self.phase = gauge(
            "miniverl_phase_seconds", description="wall time of each step phase (s)", tag_keys=("phase",)
        )
        self.memory = gauge(
            "miniverl_gpu_memory_gib", description="peak GPU memory allocated per actor (GiB)", tag_keys=("actor",)
        )

    def record(self, step: int, metrics: dict[str, float]) -> None:
        values = {"step": float(step), **metrics}
        for name, (_, key) in STEP_GAUGES.items():
            if key in values:
                self.step[name].set(float(values[key]))
        for phase in PHASES:
            if f"time/{phase}" in metrics:
                self.phase.set(float(metrics[f"time/{phase}"]), tags={"phase": phase})

    def record_memory(self, memory: dict[str, dict[str, float]]) -> None:
        """memory: actor name -> memory_report() of that actor (empty on the CPU)."""
        for actor, report in memory.items():
            if "peak_allocated_gib" in report:
                self.memory.set(report["peak_allocated_gib"], tags={"actor": actor})
