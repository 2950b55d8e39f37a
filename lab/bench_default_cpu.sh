#!/usr/bin/env bash
# Times what the README's first command does on this machine (issue 2 targets, 2 CPU cores):
#   1. building the embedded models into an empty cache (target: <= 3 minutes),
#   2. the default run, `python -m miniverl.main +experiment=<name>`, with those models cached (target: <= 5 minutes).
# Writes lab/results/default-run-cpu-<name>.json. Usage: bash lab/bench_default_cpu.sh [gkd|pg_k1]
set -euo pipefail
name=${1:-gkd}
cache=$(mktemp -d)
run=$(mktemp -d)/run
start=$(date +%s.%N)
python3 scripts/build_models.py --cache-dir "$cache" | tee /tmp/build_models.log
built=$(date +%s.%N)
python3 -m miniverl.main +experiment="$name" model.cache_dir="$cache" tracking.progress_bar=false \
  hydra.run.dir="$run" 2>&1 | grep -v "Loading weights" | tee /tmp/default_run.log
done_=$(date +%s.%N)
python3 - "$start" "$built" "$done_" "$run" "$name" <<'PY'
import json, os, platform, sys
import torch, transformers, ray
start, built, done, run, name = sys.argv[1:]
summary = json.load(open(os.path.join(run, "summary.json")))
out = {
    "date": __import__("datetime").date.today().isoformat(),
    "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, no GPU",
    "versions": {"python": platform.python_version(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "ray": ray.__version__},
    "command": f"bash lab/bench_default_cpu.sh {name}",
    "build_models_seconds": round(float(built) - float(start), 1),
    "default_run_seconds": round(float(done) - float(built), 1),
    "summary": {k: v for k, v in summary.items() if k not in ("memory", "checkpoint", "metrics_file")},
}
path = f"lab/results/default-run-cpu-{name}.json"
json.dump(out, open(path, "w"), indent=2)
print(json.dumps(out, indent=2))
PY
rm -rf "$cache"
