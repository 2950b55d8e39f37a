"""`python -m lab.bench +bench=rollout-runtime-v3`: run one preregistered benchmark (lab/conf/bench/).

Side effects (config registration, model building, the GPU) start here, never at import of miniverl.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from lab.bench.config import MAIN_NAME, register_configs

register_configs()


@hydra.main(config_path="../conf", config_name=MAIN_NAME, version_base=None)
def main(cfg: DictConfig) -> None:
    from lab.bench.runner import run_bench

    if OmegaConf.is_missing(cfg, "bench"):
        print("lab.bench: pick a benchmark, e.g. +bench=rollout-runtime-v3 (files in lab/conf/bench/)", file=sys.stderr)
        sys.exit(2)
    command = " ".join(["python -m lab.bench", *sys.argv[1:]])
    json_path, md_path = run_bench(OmegaConf.to_object(cfg.bench), command, print)
    print(f"[bench] wrote {json_path} and {md_path}")


if __name__ == "__main__":
    from miniverl.errors import ConfigError
    from miniverl.setup.argv import checked_command_line

    try:  # a malformed override in one line with its fix, as main refuses it, not Hydra's parser trace
        sys.argv[1:] = checked_command_line(sys.argv[1:], None)
    except ConfigError as e:
        print(f"lab.bench: error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
