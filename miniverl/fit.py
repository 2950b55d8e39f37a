"""`python -m miniverl.fit +experiment=gkd_4080 [key=value ...]`: will this run fit its card?

Takes the arguments `python -m miniverl.main` takes, composes the same config and prints each actor's planned GPU
memory (miniverl/setup/fit.py) without starting Ray or loading a weight. The card is resources.emulate_gpu_gib, else
this machine's GPU. The prompt files need not exist yet (memory depends on data.max_prompt_length, not on them). Exit
status 0 when the plan fits, 1 when it does not (each problem named with the knob that
fixes it), 2 for a config it cannot plan.
"""

from __future__ import annotations

import sys

NO_FIT_EXIT_CODE = 1
ERROR_EXIT_CODE = 2


def main(argv: list[str]) -> int:
    from hydra import compose, initialize_config_dir

    from miniverl.config import register_configs, to_config
    from miniverl.errors import MiniVerlError
    from miniverl.main import CONF, check_objective_overrides
    from miniverl.setup.argv import checked_command_line

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    register_configs()
    try:
        argv = checked_command_line(argv, None)  # as main refuses and rewrites them, before Hydra reads them
        check_objective_overrides(argv)
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            composed = compose(config_name="config", overrides=argv)
        cfg = to_config(composed)
        plan = plan_run(cfg, log=lambda line: print(line, file=sys.stderr))
    except MiniVerlError as e:
        print(f"miniverl.fit: error: {e}", file=sys.stderr)
        return ERROR_EXIT_CODE
    except Exception as e:  # Hydra's composition errors: a wrong override or config group
        if type(e).__module__.split(".")[0] not in ("hydra", "omegaconf"):
            raise
        why = str(e.__cause__).strip().splitlines()[0] if e.__cause__ is not None else ""  # merge errors keep it there
        print(f"miniverl.fit: error: {e}" + (f": {why}" if why and why not in str(e) else ""), file=sys.stderr)
        return ERROR_EXIT_CODE
    print("\n".join(plan.lines()))
    return 0 if not (plan.refusals or plan.warnings) else NO_FIT_EXIT_CODE


def plan_run(cfg, log=print):
    """The FitPlan of a composed run config (MiniVerlConfig) on its card: the models resolved as a run resolves them
    (built-in ones built, GGUF files converted, on first use), their sizes read without loading weights."""
    from miniverl.config import check_values
    from miniverl.models.loading import load_model_config
    from miniverl.objectives import build_objective
    from miniverl.setup.fit import card_plan
    from miniverl.setup.prepare import USER_MODEL_FIX, choose_rollout_backend, resolve_model_paths

    check_values(cfg)  # every check a run makes of the config but the prompt files': memory does not depend on them
    choose_rollout_backend(cfg, log)  # the plan sizes the rollout the run will start
    paths = resolve_model_paths(cfg.model, cfg.data, log, loads=False)  # config.json alone is enough to plan
    configs = {role: load_model_config(p, f"model.{role}.path", USER_MODEL_FIX) for role, p in paths.items()}
    return card_plan(cfg, build_objective(cfg.objective), paths, configs, configs["student"].vocab_size)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
