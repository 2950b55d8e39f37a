"""Build (or find in the cache) the built-in teacher and student, and time it; ship or check the shipped ones.

    python scripts/build_models.py [--cache-dir ~/.cache/miniverl] [--task reverse --min-len 3 --max-len 8]
    python scripts/build_models.py --experiments [--ship | --check | --fresh]

The main job does the same on first use; running it ahead of time keeps the first run short. `--experiments`
takes every built-in recipe the experiments in conf/experiment/ use. `--ship` builds those from scratch and stores
them under miniverl/models/shipped/ (what a first run copies instead of building: run it after changing a recipe,
the build code or the default data lengths; tests/models/test_shipped_models.py fails until then). `--check`
builds them from scratch in a temporary cache and compares with the shipped ones (exit 1 when they differ).
`--fresh` builds into --cache-dir from scratch even where a shipped copy exists (to time a build).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from miniverl.config import DataConfig, ModelConfig
from miniverl.models.builtin import SHIPPED_DIR, BuiltinRecipe, ensure_builtin_models, ship_model, shipped_dir

CONF = Path(__file__).resolve().parent.parent / "conf"
CHECK_TOLERANCE = 1e-2  # largest weight difference a fresh build may show against the shipped fp16 values


def experiment_recipes() -> dict[BuiltinRecipe, tuple[str, ...]]:
    """Every built-in recipe of conf/experiment/*.yaml, with the roles the experiments need of it."""
    from hydra import compose, initialize_config_dir

    from miniverl.config import register_configs, to_config
    from miniverl.setup.prepare import builtin_recipes, builtin_refs

    register_configs()
    needs: dict[BuiltinRecipe, set[str]] = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for experiment in sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")):
            cfg = to_config(compose(config_name="config", overrides=[f"+experiment={experiment}"]))
            refs = builtin_refs(cfg.model.paths(), cfg.data.task)
            for recipe, roles in builtin_recipes(refs, cfg.data.min_len, cfg.data.max_len):
                needs.setdefault(recipe, set()).update(roles)
    return {recipe: tuple(sorted(roles, reverse=True)) for recipe, roles in needs.items()}


def report(role: str, path: Path) -> None:
    info = json.loads((path / "build.json").read_text())
    print(
        f"{role}: {path} (greedy accuracy {info['greedy_accuracy']:.3f} after {info.get('steps_run', '?')} steps,"
        f" trained in {info['train_seconds']:.0f}s)"
    )


def compare(recipe: BuiltinRecipe, role: str, built: Path) -> list[str]:
    """Why a fresh build differs from the shipped model ([] when it does not)."""
    from transformers import Qwen2ForCausalLM

    shipped = shipped_dir(recipe, role)
    if not (shipped / "build.json").exists():
        return [f"{recipe.key()}/{role}: not shipped"]
    fresh = Qwen2ForCausalLM.from_pretrained(str(built), dtype=torch.float32).state_dict()
    kept = Qwen2ForCausalLM.from_pretrained(str(shipped), dtype=torch.float32).state_dict()
    worst = max((fresh[k] - kept[k]).abs().max().item() for k in kept)
    acc = [json.loads((d / "build.json").read_text())["greedy_accuracy"] for d in (built, shipped)]
    print(f"{recipe.key()}/{role}: weights differ by at most {worst:.2e}, accuracy {acc[0]:.3f} (shipped {acc[1]:.3f})")
    return [f"{recipe.key()}/{role}: weights differ by {worst:.2e}"] if worst > CHECK_TOLERANCE else []


def main() -> None:
    data, model = DataConfig(), ModelConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=model.cache_dir)
    ap.add_argument("--task", default=data.task)
    ap.add_argument("--min-len", type=int, default=data.min_len)
    ap.add_argument("--max-len", type=int, default=data.max_len)
    ap.add_argument("--experiments", action="store_true", help="every built-in recipe of conf/experiment/")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--ship", action="store_true", help="build from scratch and store under miniverl/models/shipped")
    mode.add_argument("--check", action="store_true", help="build from scratch and compare with the shipped models")
    mode.add_argument("--fresh", action="store_true", help="build from scratch into --cache-dir, ignoring shipped ones")
    args = ap.parse_args()
    if (args.ship or args.check) and not args.experiments:
        ap.error("--ship and --check work on the experiments' recipes: add --experiments")
    start = time.perf_counter()
    recipes = (
        experiment_recipes()
        if args.experiments
        else {BuiltinRecipe(args.task, args.min_len, args.max_len): ("teacher", "student")}
    )
    fresh = args.ship or args.check
    cache = Path(tempfile.mkdtemp(prefix="miniverl-build-")) if fresh else Path(args.cache_dir)
    problems = []
    try:
        if args.ship and SHIPPED_DIR.exists():
            shutil.rmtree(SHIPPED_DIR)  # recipes no experiment uses any more go with it
        for recipe, roles in recipes.items():
            paths = ensure_builtin_models(cache, recipe, roles=roles, use_shipped=not (fresh or args.fresh))
            for role in roles:
                report(role, paths[role])
                if args.ship:
                    ship_model(paths[role], shipped_dir(recipe, role))
                    print(f"  shipped as {shipped_dir(recipe, role)}")
                if args.check:
                    problems += compare(recipe, role, paths[role])
    finally:
        if fresh:
            shutil.rmtree(cache, ignore_errors=True)
    print(f"done in {time.perf_counter() - start:.0f}s")
    if problems:
        sys.exit("the shipped models differ from a fresh build:\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    main()
