"""Config helpers for the bridge tests: a run verl can reproduce, written as a composed config YAML."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from miniverl.config import OBJECTIVE_CONFIGS, MiniVerlConfig, PgK1ObjectiveConfig


def clean_config(cache_dir: Path, student: Path, teacher: Path) -> dict:
    """PG-k1 on vLLM with the teacher on its own GPU: everything verl 0.9 can express."""
    c = OmegaConf.to_container(OmegaConf.structured(MiniVerlConfig))
    c["rollout"].update(backend="vllm", n=4)
    c["objective"] = dataclasses.asdict(PgK1ObjectiveConfig(reward_coef=1.0))
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
    """Set a dotted key; `objective.name` switches to that objective's own settings (defaults), as
    choosing `objective=<name>` does."""
    if dotted == "objective.name":
        cfg["objective"] = dataclasses.asdict(OBJECTIVE_CONFIGS[value]())
        return cfg
    node = cfg
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return cfg


REWARDS_PY = """
def verl_style(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale * float(solution_str.strip() == ground_truth)


def positional(response, answer):
    return float(response == answer)


def renamed(source, response, truth, extra):
    return float(response == truth)


def extra_required(data_source, solution_str, ground_truth, extra_info, tolerance):
    return 1.0
"""


def write_prompt_files(directory: Path) -> None:
    """Prompt files for file-based runs: qa.jsonl (data_source 'qa', which reward.name=auto does not know),
    math.jsonl (gsm8k, MATH and plain rows: every auto route), and rewards.py (custom reward functions)."""
    qa = [
        {"prompt": f"{'abc'[: i % 3 + 1]}>", "answer": "abc"[: i % 3 + 1][::-1], "data_source": "qa"} for i in range(12)
    ]
    (directory / "qa.jsonl").write_text("\n".join(json.dumps(r) for r in qa) + "\n")
    sources = ("openai/gsm8k", "lighteval/MATH", "jsonl")
    math = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "data_source": sources[i % 3]} for i in range(30)]
    (directory / "math.jsonl").write_text("\n".join(json.dumps(r) for r in math) + "\n")
    (directory / "rewards.py").write_text(REWARDS_PY)
