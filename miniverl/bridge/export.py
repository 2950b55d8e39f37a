"""`export-verl` and `export-data`: read a run, refuse with every reason or write one directory atomically.

An export directory holds:
    verl_overrides.yaml   the overrides as a nested YAML mapping
    verl_command.sh       the same overrides as verl's command line
    verl_reward.py        the reward function verl calls (miniVERL's scorers routed by data_source, or the user's)
    data/train.parquet    the run's training prompts in step order, verl's schema
    data/test.parquet     its evaluation prompts
    manifest.json         miniverl and verl versions, the source run, what each file is
"""

from __future__ import annotations

import json
from pathlib import Path

from miniverl.atomic import atomic_dir
from miniverl.bridge import data as bridge_data
from miniverl.bridge import rewards as bridge_rewards
from miniverl.bridge.batches import refuse_existing
from miniverl.bridge.refusals import refuse_unless_expressible
from miniverl.bridge.runs import load_run, model_paths
from miniverl.bridge.spec import RunSpec
from miniverl.bridge.translate import REWARD_FILE, command_line, nested, verl_overrides
from miniverl.bridge.versions import DEFAULT_VERL_VERSION, miniverl_version
from miniverl.errors import ConfigError


def export_verl(source: str | Path, out: str | Path, verl_version: str = DEFAULT_VERL_VERSION) -> Path:
    """Refuse (listing every reason) or write the whole export directory `out` at once."""
    out = Path(out).absolute()
    refuse_existing(out)
    spec = load_run(source, verl_version)
    refuse_unless_expressible(spec)
    rows = spec.rows
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
    table = bridge_rewards.routes(spec.cfg.reward, spec.data_sources)
    (tmp / REWARD_FILE).write_text(bridge_rewards.reward_file_text(spec.cfg.reward, table))
    manifest = {
        "format": "miniverl-verl-export",
        "miniverl_version": miniverl_version(),
        "verl_version": spec.verl_version,
        "source": str(Path(source).absolute()),
        "objective": spec.cfg.objective.name,
        "rows": counts,
        "reward": table,  # data_source -> the reward verl calls for it
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
        rows = load_run(source).rows
    with atomic_dir(out) as tmp:
        for split, split_rows in rows.items():
            bridge_data.write_parquet(split_rows, tmp / f"{split}.parquet")
    return out
