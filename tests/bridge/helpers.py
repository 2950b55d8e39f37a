"""Config helpers for the bridge tests: a run verl can reproduce, written as a composed config YAML."""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import OmegaConf

from miniverl.config import MiniVerlConfig


def clean_config(cache_dir: Path, student: Path, teacher: Path) -> dict:
    """PG-k1 on vLLM with the teacher on its own GPU: everything verl 0.9 can express."""
    c = OmegaConf.to_container(OmegaConf.structured(MiniVerlConfig))
    c["rollout"].update(backend="vllm", n=4)
    c["objective"].update(name="pg_k1", reward_coef=1.0)
    c["resources"].update(gpus=1, scorer_gpus=1)
    c["trainer"].update(total_steps=3, micro_batch_size=16)
    c["data"].update(prompts_per_step=8, eval_prompts=4)
    c["model"]["cache_dir"] = str(cache_dir)  # empty: built-in models are not built here
    c["model"]["student"]["path"], c["model"]["teacher"]["path"] = str(student), str(teacher)
    return c


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def set_key(cfg: dict, dotted: str, value) -> dict:
    node = cfg
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return cfg
