"""Checks that need more than the config's own values (the model's layers, credentials, the device, the
run directory), all made in the driver before Ray starts, each naming the key and the fix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from miniverl.checkpoints.compat import check_resumable
from miniverl.checkpoints.files import CheckpointError
from miniverl.checkpoints.store import (
    CHECKPOINTS_DIR,
    check,
    holds_run,
    list_checkpoints,
    load_valid_state,
    newest_valid,
    scan,
    set_aside,
)
from miniverl.config import MiniVerlConfig
from miniverl.errors import ConfigError
from miniverl.models.lora import meta_linear_layers
from miniverl.setup.placement import placement_gpus

WANDB_HOST = "api.wandb.ai"


def linear_layer_names(model_path: str) -> set[str]:
    """Last name component of every linear layer of the model at `model_path` (what LoRA targets match)."""
    from transformers import AutoConfig

    local = Path(model_path).expanduser()
    config = AutoConfig.from_pretrained(str(local) if local.exists() else model_path)
    return {name for name, _ in meta_linear_layers(config)}


def check_lora_targets(model_path: str, targets: list[str] | tuple[str, ...]) -> None:
    names = linear_layer_names(model_path)
    missing = [t for t in targets if t not in names]
    if missing:
        raise ConfigError(
            f"model.lora.target_modules names {missing}, which the student at {model_path!r} does not have;"
            f" its linear layers are {sorted(names)}"
        )


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators(WANDB_HOST) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def check_tracking(mode: str) -> None:
    if mode == "online" and not has_wandb_credentials():
        raise ConfigError(
            "tracking.wandb_mode=online but no wandb credentials were found (no WANDB_API_KEY, no"
            f" {WANDB_HOST} entry in ~/.netrc); run `wandb login`, or use tracking=offline"
        )


def check_gpu_request(cfg: MiniVerlConfig, device: str, cuda_devices: int, ray_running: bool) -> None:
    """GPUs asked for (resources.gpus, scorer_gpus) must exist: a local Ray cluster started by this run gets the
    machine's CUDA devices (`cuda_devices`), so more fails now, not after Ray started; an existing cluster
    (`ray_running`, resources.ray_address) may have logical GPUs and is checked once connected."""
    res = cfg.resources
    gpus = placement_gpus(res.gpus, device)
    if res.scorer_gpus and not gpus:
        raise ConfigError(
            f"resources.scorer_gpus={res.scorer_gpus} gives the teacher GPUs of its own, but this run places no"
            f" actor on a GPU (resources.gpus={res.gpus} resolves to 0 on the CPU), so it would be ignored; drop"
            " resources.scorer_gpus, or run on a GPU machine"
        )
    need = gpus + res.scorer_gpus
    if need > cuda_devices and res.ray_address is None and not ray_running:
        cpu = " (on the CPU: drop resources.gpus and resources.scorer_gpus)" if device == "cpu" else ""
        raise ConfigError(
            f"resources.gpus={res.gpus} and resources.scorer_gpus={res.scorer_gpus} ask for {need} GPUs, but this"
            f" machine has {cuda_devices} CUDA devices, and so would the local Ray cluster this run starts; ask for"
            f" at most {cuda_devices}{cpu}, or connect to a Ray cluster that has them (resources.ray_address=...)"
        )


def check_device_settings(cfg: MiniVerlConfig, device: str) -> None:
    """GPU-only settings on a CPU run would be silently ignored; refuse them instead. On a GPU, every actor's
    share of an emulated card must leave room beyond its CUDA context."""
    if device != "cpu":
        if cfg.resources.emulate_gpu_gib is not None:
            from miniverl.process import emulated_cap_gib

            for actor in ("rollout", "scorer", "learner"):
                whole = actor == "scorer" and cfg.resources.scorer_gpus > 0  # a dedicated GPU
                fraction = 1.0 if whole else getattr(cfg.resources, actor).num_gpus
                if fraction is None:  # chosen by the plan, which refuses a share its context fills
                    continue
                if actor == "scorer" and cfg.model.teacher_is_self:  # no scorer process: the learner scores
                    continue
                emulated_cap_gib(cfg.resources.emulate_gpu_gib, fraction, f"resources.{actor}.num_gpus")
        return
    if cfg.resources.emulate_gpu_gib is not None:
        raise ConfigError(
            f"resources.emulate_gpu_gib={cfg.resources.emulate_gpu_gib} caps GPU memory, but this run computes on"
            " the CPU; drop it, or run on a GPU (resources.device=cuda)"
        )
    for role, spec in (("student", cfg.model.student), ("teacher", cfg.model.teacher)):
        if spec.dtype == "float16":
            raise ConfigError(
                f"model.{role}.dtype=float16 is a GPU dtype (many CPU kernels lack it); use auto or float32 on the CPU"
            )


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts: the checkpoint, the step it holds, and the run's step-0 evaluation."""

    path: Path
    step: int
    first_eval: dict[str, float]


def resume_source(resume: str, run_dir: Path) -> tuple[Path, dict] | None:
    """(checkpoint, its saved config) that trainer.resume points at, or None when there is none to read
    (resolve_resume then starts fresh or refuses, with the reason)."""
    if resume == "none":
        return None
    path = newest_valid(run_dir, lambda *_: None) if resume == "auto" else Path(resume).expanduser()
    if path is None or not path.is_dir():
        return None
    try:
        return path, load_valid_state(path)["config"]
    except CheckpointError:
        return None


def resolve_resume(cfg: MiniVerlConfig, run_dir: Path, config: dict, log=print) -> ResumePoint | None:
    """The checkpoint this run continues, or None for a fresh start; refuses to mix two runs in one directory.

    `config` is the current config as a plain dict (dataclasses.asdict), compared with the checkpoint's.
    Unusable checkpoints newer than the one resumed would stand where the resumed run saves its steps again
    (issue 38: refused after Ray started, at every resume): once every resume check passed, each is moved
    aside (store.set_aside) and named in one line, so they are kept for the user and out of the run's way.
    """
    resume = cfg.trainer.resume
    markers = holds_run(run_dir)
    if resume == "none":
        if markers:
            raise ConfigError(
                f"the run directory {run_dir} already holds a run ({', '.join(markers)}); continue it with"
                " trainer.resume=auto, or pick another directory (hydra.run.dir=...)"
            )
        return None
    if resume == "auto":
        path, in_the_way = scan(run_dir)
        if path is None:
            if markers:
                found = len(list_checkpoints(run_dir))
                raise ConfigError(
                    f"trainer.resume=auto: the run directory {run_dir} holds a run ({', '.join(markers)}) but"
                    f" no usable checkpoint ({found} found, none valid); start in another directory"
                )
            return None
    else:
        path = Path(resume).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"trainer.resume={resume!r}: no such checkpoint directory; use auto, none or a step_<k> path"
            )
        inside = path.resolve().parent == (run_dir / CHECKPOINTS_DIR).resolve()
        if markers and not inside:
            raise ConfigError(
                f"trainer.resume={resume!r} continues another run's checkpoint, but {run_dir} already holds a run"
                f" ({', '.join(markers)}); resume into a fresh directory"
            )
        later = [p for p in list_checkpoints(run_dir) if inside and p.name > path.name]
        in_the_way = [bad for bad in map(check, later) if bad is not None]
        newer = [p.name for p in later if p not in {bad.path for bad in in_the_way}]
        if newer:
            raise ConfigError(
                f"trainer.resume={resume!r} is older than {', '.join(newer)} in the same run, which the resumed run"
                " would have to overwrite; resume the newest (trainer.resume=auto) or move the newer ones away"
            )
    state = load_valid_state(path)
    for note in check_resumable(state["config"], config, str(path)):
        log(f"[miniverl] {note}")
    if state["step"] >= cfg.trainer.total_steps:
        raise ConfigError(
            f"checkpoint {path} already finished step {state['step']} of trainer.total_steps={cfg.trainer.total_steps};"
            " raise trainer.total_steps to train further"
        )
    for bad in in_the_way:  # last: a refused resume leaves the run directory as it was
        moved = set_aside(bad.path)
        log(
            f"[miniverl] moved the unusable checkpoint {bad.path.name} aside to {moved} ({bad.error.reason}), out of"
            f" the way of the run continuing from {path.name}; the folder is kept for you to inspect or delete"
        )
    return ResumePoint(path, int(state["step"]), state["first_eval"])
