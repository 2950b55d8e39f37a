"""`export-verl` and `export-data`: read a run, refuse with every reason or write one directory atomically.

An export directory holds:
    verl_overrides.yaml   the overrides as a nested YAML mapping
    verl_command.sh       the same overrides as verl's command line
    verl_reward.py        the reward function verl calls
    data/train.parquet    the run's training prompts in step order, verl's schema
    data/test.parquet     its evaluation prompts
    manifest.json         miniverl and verl versions, the source run, what each file is
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from miniverl.bridge import data as bridge_data
from miniverl.bridge.atomic import atomic_dir, refuse_existing
from miniverl.bridge.refusals import RunSpec, refuse_unless_expressible
from miniverl.bridge.translate import REWARD_FILE, command_line, nested, verl_overrides
from miniverl.bridge.versions import DEFAULT_VERL_VERSION, miniverl_version
from miniverl.config import MiniVerlConfig, to_config, validate
from miniverl.models.builtin import BUILTIN_PREFIX, BuiltinRecipe, builtin_dir
from miniverl.protocol import ConfigError

RUN_CONFIG = Path(".hydra") / "config.yaml"
# Keys a newer miniVERL schema may carry that this one lacks; the bridge reads them before typing the rest.
FORWARD_KEYS = {"quantization": ("model", "student", "quantization"), "reward": ("reward", "name")}


def _pop_path(tree: dict, path: tuple[str, ...]):
    node = tree
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None
    return node.pop(path[-1], None) if isinstance(node, dict) else None


def load_run(source: str | Path, verl_version: str = DEFAULT_VERL_VERSION) -> RunSpec:
    """A run dir (its .hydra/config.yaml) or a composed config YAML, typed and validated, as a RunSpec."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(source)
    file = path / RUN_CONFIG if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"{source}: neither a run directory with {RUN_CONFIG} nor a config file; pass outputs/<date>/<time>"
            " or a YAML written by `python -m miniverl.main ... --cfg job`"
        )
    raw = yaml.safe_load(file.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a mapping of config groups, got {type(raw).__name__}")
    extras = {name: None if _schema_has(path) else _pop_path(raw, path) for name, path in FORWARD_KEYS.items()}
    if isinstance(raw.get("reward"), dict) and not raw["reward"]:
        raw.pop("reward")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(MiniVerlConfig), raw)
    except OmegaConfBaseException as e:  # an unknown key or a wrong type
        raise ConfigError(
            f"{file}: {str(e).splitlines()[0]}; the config must fit this miniVERL's schema (miniverl/config.py)"
        ) from e
    cfg = to_config(merged)
    if _schema_has(FORWARD_KEYS["quantization"]):
        extras["quantization"] = getattr(cfg.model.student, "quantization", None)
    # The rollout backend is judged against verl's engines (refusals), whether or not this miniVERL has it
    # registered, so validation runs the other checks with a known backend in its place.
    validate(replace(cfg, rollout=replace(cfg.rollout, backend="hf_reference")))
    student, _ = model_paths(cfg)
    return RunSpec(
        cfg=cfg,
        verl_version=verl_version,
        student_quantization=extras["quantization"],
        reward=extras["reward"],
        student_vocab_size=_vocab_size(student),
    )


def _schema_has(key_path: tuple[str, ...]) -> bool:
    import dataclasses

    node = MiniVerlConfig
    for key in key_path:
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if key not in fields:
            return False
        default = fields[key].default_factory() if callable(fields[key].default_factory) else fields[key].default
        node = type(default) if dataclasses.is_dataclass(default) else None
    return True


def model_paths(cfg: MiniVerlConfig) -> tuple[str, str]:
    """Student and teacher as verl loads them: built-in models resolve to their cache directories."""
    recipe = BuiltinRecipe(cfg.data.task, cfg.data.min_len, cfg.data.max_len)

    def resolve(path: str) -> str:
        if path.startswith(BUILTIN_PREFIX):
            return str(builtin_dir(cfg.model.cache_dir, recipe) / path[len(BUILTIN_PREFIX) :])
        return path

    return resolve(cfg.model.student.path), resolve(cfg.model.teacher.path)


def _vocab_size(model_path: str) -> int | None:
    file = Path(model_path).expanduser() / "config.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text()).get("vocab_size")


def export_verl(source: str | Path, out: str | Path, verl_version: str = DEFAULT_VERL_VERSION) -> Path:
    """Refuse (listing every reason) or write the whole export directory `out` at once."""
    out = Path(out).absolute()
    refuse_existing(out)
    spec = load_run(source, verl_version)
    refuse_unless_expressible(spec)
    rows = bridge_data.prompt_rows(spec.cfg)
    student, teacher = model_paths(spec.cfg)
    overrides = verl_overrides(spec, student, teacher, out / "data", out / REWARD_FILE)
    env = {"WANDB_MODE": spec.cfg.tracking.wandb_mode} if spec.cfg.tracking.wandb_mode != "disabled" else {}
    with atomic_dir(out) as tmp:
        _write_export(tmp, spec, rows, overrides, env, source)
    return out


def _write_export(tmp: Path, spec: RunSpec, rows: dict, overrides: dict, env: dict, source) -> None:
    import yaml

    (tmp / "data").mkdir()
    counts = {split: bridge_data.write_parquet(r, tmp / "data" / f"{split}.parquet") for split, r in rows.items()}
    (tmp / "verl_overrides.yaml").write_text(yaml.safe_dump(nested(overrides), sort_keys=False))
    script = tmp / "verl_command.sh"
    script.write_text(
        "#!/usr/bin/env bash\n# Runs the exported miniVERL run with verl.\n" + command_line(overrides, env)
    )
    script.chmod(0o755)
    shutil.copyfile(Path(__file__).with_name("verl_reward.py"), tmp / REWARD_FILE)
    manifest = {
        "format": "miniverl-verl-export",
        "miniverl_version": miniverl_version(),
        "verl_version": spec.verl_version,
        "source": str(Path(source).absolute()),
        "objective": spec.cfg.objective.name,
        "rows": counts,
        "files": ["verl_overrides.yaml", "verl_command.sh", REWARD_FILE, "data/train.parquet", "data/test.parquet"],
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def export_data(
    out: str | Path,
    source: str | Path | None = None,
    jsonl: str | Path | None = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> Path:
    """Prompt data alone as verl parquet: a run's prompts (source) or a user's jsonl file, written atomically."""
    if (source is None) == (jsonl is None):
        raise ConfigError("pass either a run directory / config (SOURCE) or --jsonl FILE, not both or neither")
    out = Path(out).absolute()
    refuse_existing(out)
    if jsonl is not None:
        rows = {"train": bridge_data.jsonl_rows(jsonl, prompt_key, answer_key)}
    else:
        rows = bridge_data.prompt_rows(load_run(source).cfg)
    with atomic_dir(out) as tmp:
        for split, split_rows in rows.items():
            bridge_data.write_parquet(split_rows, tmp / f"{split}.parquet")
    return out
