"""The run's state on the Ray dashboard: gauges recorded through `ray.util.metrics` after every step.

Ray exports them to Prometheus (the dashboard's Metrics tab shows them when Prometheus/Grafana are set
up: docs/objectives.md, "Metrics every step"). Names start with `miniverl_`; phases and actors are tags, so one
panel shows all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
