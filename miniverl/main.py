"""Hydra entry point: `python -m miniverl.main +experiment=gkd`.

Side effects (config registration, Ray, wandb, logging) start here and nowhere at import.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from miniverl.config import foreign_objective_key, register_configs, to_config

ERROR_EXIT_CODE = 2  # a problem the message explains (config, fault); 128+N after signal N (130 = Ctrl-C)
CONF = Path(__file__).resolve().parent.parent / "conf"

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from miniverl.faults import RunInterrupted
    from miniverl.protocol import MiniVerlError
    from miniverl.run import train

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = train(to_config(cfg), run_dir, OmegaConf.to_container(cfg, resolve=True))
    except RunInterrupted as e:
        print(f"\nminiverl: interrupted: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except MiniVerlError as e:
        print(f"\nminiverl: error: {e}", file=sys.stderr, flush=True)
        sys.exit(ERROR_EXIT_CODE)
    print_summary(summary, run_dir)


def check_objective_overrides(argv: list[str]) -> None:
    """`objective.<key>=v` for a key the chosen objective does not own: Hydra refuses it suggesting
    `+objective.<key>`, the wrong fix. This names the key, the objective owning it and the fix instead,
    before Hydra composes the run (and so before Ray). Raises ConfigError."""
    from miniverl.protocol import ConfigError

    keyed = [(a, a.lstrip("+~").split("=", 1)[0]) for a in argv if "=" in a and not a.startswith("-")]
    asked = [k.split(".", 1)[1] for _, k in keyed if k.startswith("objective.")]
    if not asked:
        return
    rest = [a for a, k in keyed if not k.startswith(("objective.", "hydra."))]
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            objective = compose(config_name="config", overrides=rest).objective.name
    except Exception:
        return
    for key in asked:
        error = foreign_objective_key(objective, key.split(".", 1)[0])
        if error:
            raise ConfigError(error)


def print_summary(summary: dict, run_dir: Path) -> None:
    print(
        "\n[miniverl] done: {steps} steps of {objective} on {device} in {wall_seconds:.0f}s\n"
        "  reverse KL to teacher (nats/token): {start_reverse_kl:.4f} -> {end_reverse_kl:.4f}\n"
        "  greedy task accuracy:               {start_accuracy:.3f} -> {end_accuracy:.3f}".format(**summary)
    )
    print(f"  run directory: {run_dir} (config, metrics.jsonl, summary.json, checkpoints/, plots, wandb/)")
    memory = {k: v for k, v in summary["memory"].items() if v}
    if memory:
        print(f"  peak GPU memory per actor (GiB): {json.dumps(memory)}")


if __name__ == "__main__":
    from miniverl.protocol import ConfigError

    try:
        check_objective_overrides(sys.argv[1:])
    except ConfigError as e:
        print(f"miniverl: error: {e}", file=sys.stderr, flush=True)
        sys.exit(ERROR_EXIT_CODE)
    main()
