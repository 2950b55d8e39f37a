"""The run's summary (summary.json and the last lines it prints) and the version a checkpoint records."""

from __future__ import annotations

from typing import Any

from miniverl.cluster.actors import call
from miniverl.cluster.colocate import processes
from miniverl.config import MiniVerlConfig
from miniverl.routing import teacher_name
from miniverl.setup.records import Setup
from miniverl.step.evaluation import summary_by_source


def run_summary(
    cfg: MiniVerlConfig,
    setup: Setup,
    result,
    actors: dict[str, list[Any]],
    resumed_from: str | None,
    gate: dict[str, Any],
    metrics_file: str,
    wall_seconds: float,
) -> dict[str, Any]:
    """A finished run: its first and last evaluation, where it went, peak memory per actor process and the plan it
    was started on (None on the CPU), the gate's numbers.

    `result` is the loop's LoopResult (first_eval, last_eval, checkpoint, version_test).
    """
    memory = {name: call(a, "memory") for name, a in processes(actors).items()}
    return {
        "status": "finished",
        "steps": cfg.trainer.total_steps,
        "resumed_from": resumed_from,
        "objective": cfg.objective.name,
        "rollout_backend": cfg.rollout.backend,
        "device": setup.device,
        "chosen": setup.chosen,  # what the plan chose where the config left it null (shares, learner layout)
        "start_reverse_kl": result.first_eval["eval/reverse_kl"],
        "end_reverse_kl": result.last_eval["eval/reverse_kl"],
        "start_accuracy": result.first_eval["eval/accuracy"],
        "end_accuracy": result.last_eval["eval/accuracy"],
        "by_source": summary_by_source(result.first_eval, result.last_eval),
        "teachers": {
            teacher_name(r): f"self ({setup.paths[r]})" if cfg.model.teacher_is_self else setup.paths[r]
            for r in cfg.model.teacher_roles()
        },
        "wall_seconds": wall_seconds,
        "checkpoint": result.checkpoint,
        "metrics_file": metrics_file,
        "overlong_prompts_filtered": setup.prompts.overlong_count,
        "memory": memory,
        "plan": setup.plan,  # what the run planned for the memory above (None on the CPU)
        "conformance": gate,
        "version_test": result.version_test,  # objectives/sampler_check.py VersionTestWatch: steps voted, armed
    }


def version() -> str:
    """The installed miniverl version (recorded in checkpoints)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("miniverl")
    except PackageNotFoundError:
        return "unknown (not installed)"
