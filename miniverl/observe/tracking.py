"""Run tracking: metrics.jsonl (one line per step), wandb (offline by default) and a progress bar."""

from __future__ import annotations

import json
import os
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
