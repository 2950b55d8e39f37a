"""The entry point: `python -m miniverl.main +experiment=gkd` (Hydra), and train(), one whole run.

Side effects (config registration, Ray, wandb, logging) start here and nowhere at import.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from miniverl.config import MiniVerlConfig, foreign_objective_key, register_configs, to_config

ERROR_EXIT_CODE = 2  # a problem the message explains (config, fault); 128+N after signal N (130 = Ctrl-C)
HYDRA_DIR = ".hydra"  # the run's record, as Hydra would write it (conf/config.yaml turns Hydra's own off)
CONF = Path(__file__).resolve().parent.parent / "conf"

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from miniverl.cluster.faults import RunInterrupted, StartupInterrupted, StartupSignals, guard_output
    from miniverl.errors import MiniVerlError, message_of
    from miniverl.process import quiet_library_notes

    guard_output()  # `| tee log` whose reader died: the run stops with a checkpoint instead of crashing
    quiet_library_notes()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    try:
        with StartupSignals():
            cfg = continue_saved_run(cfg, run_dir, overrides)
            files = run_record(cfg, hydra_cfg, overrides, run_dir)
            summary = train(to_config(cfg), run_dir, OmegaConf.to_container(cfg, resolve=True), run_files=files)
    except StartupInterrupted as e:
        print(f"\nminiverl: {e} while starting: stopped before the first step, nothing to save", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # a second signal while a step ran: stopped at once
        print("\nminiverl: stopped at once by a second signal; the last checkpoint is as it was", file=sys.stderr)
        sys.exit(130)
    except RunInterrupted as e:
        print(f"\nminiverl: interrupted: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except MiniVerlError as e:
        print(f"\nminiverl: error: {message_of(e)}", file=sys.stderr, flush=True)
        sys.exit(ERROR_EXIT_CODE)
    print_summary(summary, run_dir)


def train(
    cfg: MiniVerlConfig,
    run_dir: Path,
    config_dict: dict[str, Any],
    log=print,
    after_step: Callable[[int, dict[str, list[Any]]], None] | None = None,
    run_files: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The whole run: setup (checks, models), cluster (Ray, actors), the steps, the summary; returns the
    summary (also written to run_dir/summary.json).

    Everything that can be checked is checked before Ray starts. `after_step(step, actors)` runs after
    each completed step (tests use it to inject faults). `run_files` (path in run_dir -> text: main's
    .hydra/*.yaml) are written once every check has passed, so a refused run touches nothing. The run holds
    run_dir's lock (run_lock.py) from before its first check to its end: a second run there is refused.
    """
    from miniverl.run_lock import RunLock

    with RunLock(run_dir, log):
        return train_holding_the_lock(cfg, run_dir, config_dict, log, after_step, run_files)


def train_holding_the_lock(
    cfg: MiniVerlConfig,
    run_dir: Path,
    config_dict: dict[str, Any],
    log,
    after_step: Callable[[int, dict[str, list[Any]]], None] | None,
    run_files: dict[str, str] | None,
) -> dict[str, Any]:
    """train's run, once it holds run_dir's lock."""
    import ray

    from miniverl.atomic import atomic_write_text
    from miniverl.checkpoints.compat import identity_hash
    from miniverl.cluster.actors import call_all
    from miniverl.cluster.faults import RunInterrupted, StartupInterrupted, StopRequests
    from miniverl.cluster.launch import build_actors, start_ray, teardown
    from miniverl.errors import MiniVerlError, disk_full, message_of
    from miniverl.observe.plots import write_plots
    from miniverl.observe.tracking import RunGauges, Tracker, trim_metrics
    from miniverl.seeds import sampling_seed
    from miniverl.setup.prepare import prepare_run
    from miniverl.step.cadence import TrainingLoop
    from miniverl.step.conformance import conformance_gate
    from miniverl.step.controller import StrictSyncController
    from miniverl.step.evaluation import run_summary

    started = time.perf_counter()
    typed_config = dataclasses.asdict(cfg)
    resume, setup = prepare_run(cfg, run_dir, typed_config, log)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (run_files or {}).items():  # written only now: a refused run leaves the directory as it was
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    if setup.plan:  # before Ray: a run killed from outside (the machine taken back) writes no summary.json
        (run_dir / "plan.json").write_text(json.dumps(setup.plan, indent=2))
    if resume is not None:
        for name in ("metrics.jsonl", "samples.jsonl"):  # the steps after it are done again
            trim_metrics(run_dir / name, resume.step)
    objective = setup.objective
    started_ray = start_ray(cfg, log)
    # a run that fails or is interrupted keeps the plan it started from (an out-of-memory run is where it matters)
    tracker, actors, pg, loop = None, {}, None, None
    status: dict[str, Any] = {"status": "failed", "plan": setup.plan}
    try:
        actors, pg = build_actors(cfg, setup, objective)
        log(f"[miniverl] actors ready on {setup.device} ({time.perf_counter() - started:.1f}s since start)")
        start, first = 0, None
        if resume is not None:
            # The rollout side is not loaded here: the loop's first refresh publishes the restored policy
            # and proves the engines serve it (strict sync), exactly as after any update.
            restored = call_all(actors["learner"], "load_checkpoint", [(str(resume.path),)] * len(actors["learner"]))
            log(f"[miniverl] resumed from {resume.path}: step {resume.step}, policy {restored[0].short()}")
            start, first = resume.step, resume.first_eval
        controller = StrictSyncController(
            actors["rollout"],
            actors["scorer"],
            actors["learner"],
            setup.reward_fn,
            objective.teacher_support_k,
            objective.loss_temperature,
            routing=setup.routing,
            staleness=cfg.trainer.staleness,
            weight_sync=cfg.resources.weight_sync,
            probe_every=cfg.trainer.probe_every,
        )
        params = setup.sampling
        names = (cfg.objective.name, cfg.rollout.backend)
        gate_seed = sampling_seed(cfg.rollout.seed, "gate", 0)
        gate = conformance_gate(controller, setup.eval_batch, params, objective, names, log, gate_seed)
        tr, t = cfg.tracking, cfg.trainer
        tracked = {**config_dict, "chosen": setup.chosen}  # wandb's config shows what the run chose, not only null
        tracker = Tracker(
            run_dir, tracked, tr.wandb_mode, tr.project, tr.run_name, t.total_steps, tr.progress_bar, start
        )
        meta = {"config": typed_config, "config_hash": identity_hash(typed_config), "miniverl_version": version()}
        resumed_from = str(resume.path) if resume else None
        with StopRequests() as stop:
            loop = TrainingLoop(
                cfg, setup, controller, actors, tracker, run_dir, meta, stop, RunGauges(), after_step, resumed_from
            )
            try:
                result = loop.run(start, first)
            except RunInterrupted:
                status = {"status": "interrupted", "checkpoint": loop.checkpoint, "plan": setup.plan}
                raise
        wall = time.perf_counter() - started
        status = run_summary(cfg, setup, result, actors, resumed_from, gate, str(tracker.metrics_path), wall)
        return status
    except MiniVerlError as e:
        status.setdefault("error", first_line(message_of(e)))
        raise
    except StartupInterrupted as e:  # a signal before the first step (StartupSignals): nothing to save yet
        status = {"status": "interrupted", "error": f"{e} while starting: stopped before the first step, nothing saved"}
        status["plan"] = setup.plan
        raise
    except KeyboardInterrupt as e:  # a second signal mid-step (StopRequests): stopped at once, nothing saved
        saved = loop.checkpoint if loop is not None else None
        kept = f"the last checkpoint {saved} is as it was" if saved else "no checkpoint was written"
        status = {"status": "interrupted", "error": f"{e or 'a second signal'}; {kept}", "checkpoint": saved}
        status["plan"] = setup.plan
        raise
    except OSError as e:  # the driver's own files: metrics.jsonl, samples.jsonl, plots
        full = disk_full(e, e.filename or run_dir, "continue with trainer.resume=auto: the last checkpoint is intact")
        status["error"] = str(full) if full else f"{type(e).__name__}: {first_line(str(e))}"
        if full is None:
            raise
        raise full from e
    except Exception as e:
        status["error"] = f"{type(e).__name__}: {first_line(message_of(e))}"
        raise
    finally:
        if tracker is not None:
            try:
                tracker.finish(status)
            except OSError as e:  # a full disk refuses summary.json itself: say so rather than hide the cause
                log(f"[miniverl] could not write {run_dir / 'summary.json'} ({e.strerror or e}): {status}")
            if cfg.tracking.plots:
                write_plots(tracker.metrics_path, run_dir, log)
        else:  # ended before tracking began (Ray, the actors, the gate): the summary says how, all the same
            try:
                atomic_write_text(run_dir / "summary.json", json.dumps(status, indent=2))
            except OSError as e:
                log(f"[miniverl] could not write {run_dir / 'summary.json'} ({e.strerror or e}): {status}")
        if started_ray:
            ray.shutdown()
        else:
            teardown(actors, pg)


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def continue_saved_run(cfg: DictConfig, run_dir: Path, overrides: list[str], log=print) -> DictConfig:
    """With trainer.resume=auto|<checkpoint>: the saved run's config plus what this command sets as key=value.

    Without it the README's resume command would silently revert every setting the first command gave
    (data.train_files back to the built-in task). Whether the keys set now may change is compat's call.
    """
    from miniverl.checkpoints.compat import command_line_keys
    from miniverl.checkpoints.resume_config import resumed_config
    from miniverl.setup.preflight import resume_source

    saved = resume_source(cfg.trainer.resume, run_dir)
    if saved is None:
        return cfg  # a fresh start, or a resume that train's checks refuse with the reason
    path, saved_config = saved
    keys, groups = command_line_keys(overrides)
    merged, kept = resumed_config(cfg, saved_config, keys)
    changed = [k for k in keys if k != "trainer.resume"]
    log(f"[miniverl] resuming {path} under its run's config; set now: {', '.join(changed) or 'nothing'}")
    if groups and kept:
        more = f" and {len(kept) - 5} more" if len(kept) > 5 else ""
        log(
            f"[miniverl] not applied to a resumed run: config-group choices ({' '.join(groups)}); it keeps its saved"
            f" values where this command's config differs: {', '.join(kept[:5])}{more} (set key=value to change one)"
        )
    return merged


def run_record(cfg: DictConfig, hydra_cfg, overrides: list[str], run_dir: Path) -> dict[str, str]:
    """.hydra/config.yaml (the config this run trains under), hydra.yaml and overrides.yaml (this command's,
    after the earlier commands' of a resumed run), written by train once every check has passed."""
    old = run_dir / HYDRA_DIR / "overrides.yaml"
    earlier = list(OmegaConf.load(old)) if cfg.trainer.resume != "none" and old.is_file() else []
    return {
        f"{HYDRA_DIR}/config.yaml": OmegaConf.to_yaml(cfg),
        f"{HYDRA_DIR}/hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
        f"{HYDRA_DIR}/overrides.yaml": OmegaConf.to_yaml(OmegaConf.create(earlier + overrides)),
    }


def check_objective_overrides(argv: list[str]) -> None:
    """`objective.<key>=v` for a key the chosen objective does not own: Hydra refuses it suggesting
    `+objective.<key>`, the wrong fix. This names the key, the objective owning it and the fix instead,
    before Hydra composes the run (and so before Ray). Raises ConfigError."""
    from miniverl.errors import ConfigError

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
    if summary.get("teacher_context_accuracy") is not None:  # model.teacher.path=self with teacher prompts
        print(f"  the teacher with its context:       {summary['teacher_context_accuracy']:.3f} (greedy, step 0)")
    print(f"  run directory: {run_dir} ({', '.join(written(run_dir))})")
    memory = {k: v for k, v in summary["memory"].items() if v}
    if memory:
        print(
            "  peak GPU memory per actor (GiB; alloc_retries: how often its allocator emptied its cache to fit under"
            f" the cap): {json.dumps(memory)}"
        )


RUN_OUTPUTS = (  # (what is listed, the path that shows it was written)
    ("config", f"{HYDRA_DIR}/config.yaml"),
    ("metrics.jsonl", "metrics.jsonl"),
    ("samples.jsonl", "samples.jsonl"),
    ("summary.json", "summary.json"),
    ("plan.json", "plan.json"),
    ("checkpoints/", "checkpoints"),
    ("plots", "reverse_kl.png"),
    ("wandb/", "wandb"),
)


def written(run_dir: Path) -> list[str]:
    """What the run left in its directory, in the README's order (wandb/ only when tracking wrote it)."""
    return [name for name, path in RUN_OUTPUTS if (run_dir / path).exists()]


def version() -> str:
    """The installed miniverl version (recorded in checkpoints)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("miniverl")
    except PackageNotFoundError:
        return "unknown (not installed)"


if __name__ == "__main__":
    from miniverl.errors import ConfigError
    from miniverl.setup.argv import checked_command_line

    try:
        # Hydra reads sys.argv itself: what it would answer with a traceback is refused here in one line, and the
        # dict forms of dict-valued keys that it refuses are rewritten there into the forms it accepts.
        default_run_dir = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["hydra"]["run"]["dir"]
        sys.argv[1:] = checked_command_line(sys.argv[1:], default_run_dir)
        check_objective_overrides(sys.argv[1:])
    except ConfigError as e:
        print(f"miniverl: error: {e}", file=sys.stderr, flush=True)
        sys.exit(ERROR_EXIT_CODE)
    main()
