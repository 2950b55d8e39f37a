"""Build (or find in the cache) the embedded default teacher and student, and time it.

    python scripts/build_models.py [--cache-dir ~/.cache/miniverl] [--task reverse --min-len 3 --max-len 8]

The main job does the same on first use; running it ahead of time keeps the first run short.
"""

from __future__ import annotations

import argparse
import json
import time

from miniverl.config import DataConfig, ModelConfig
from miniverl.models.builtin import BuiltinRecipe, ensure_builtin_models


def main() -> None:
    data, model = DataConfig(), ModelConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=model.cache_dir)
    ap.add_argument("--task", default=data.task)
    ap.add_argument("--min-len", type=int, default=data.min_len)
    ap.add_argument("--max-len", type=int, default=data.max_len)
    args = ap.parse_args()
    start = time.perf_counter()
    paths = ensure_builtin_models(args.cache_dir, BuiltinRecipe(args.task, args.min_len, args.max_len))
    for role, path in paths.items():
        info = json.loads((path / "build.json").read_text())
        print(
            f"{role}: {path} (greedy accuracy {info['greedy_accuracy']:.3f}, trained in {info['train_seconds']:.0f}s)"
        )
    print(f"done in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
