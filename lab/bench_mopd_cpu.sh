#!/usr/bin/env bash
# Multi-teacher distillation on the CPU (issue 18): +experiment=mopd, its single-teacher baseline mopd_single, and
# the single-task default gkd, one after the other with the built-in models in the default cache (built on first
# use: the build time then counts in the first run's wall time). Writes lab/results/mopd-cpu.json.
# Usage: bash lab/bench_mopd_cpu.sh [experiment ...]   (default: mopd mopd_single gkd)
set -euo pipefail
names=("$@"); [ ${#names[@]} -gt 0 ] || names=(mopd mopd_single gkd)
root=$(mktemp -d)
for name in "${names[@]}"; do
  start=$(date +%s.%N)
  python3 -m miniverl.main +experiment="$name" tracking.progress_bar=false tracking.plots=false \
    hydra.run.dir="$root/$name" 2>&1 | grep -v -e "Loading weights" -e "Writing model shards" | tee "$root/$name.log"
  echo "$(date +%s.%N) - $start" | bc > "$root/$name.seconds"
done
python3 - "$root" "${names[@]}" <<'PY'
import json, os, platform, statistics, sys
import torch, transformers, ray
root, names = sys.argv[1], sys.argv[2:]
path = "lab/results/mopd-cpu.json"
out = json.load(open(path)) if os.path.exists(path) else {"runs": {}}
out.update({
    "date": __import__("datetime").date.today().isoformat(),
    "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, no GPU, shared",
    "versions": {"python": platform.python_version(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "ray": ray.__version__},
    "command": "bash lab/bench_mopd_cpu.sh " + " ".join(names),
})
for name in names:
    summary = json.load(open(os.path.join(root, name, "summary.json")))
    rows = [json.loads(line) for line in open(os.path.join(root, name, "metrics.jsonl"))]
    evals = {r["step"]: {k[5:]: round(v, 4) for k, v in r.items() if k.startswith("eval/")} for r in rows
             if "eval/accuracy" in r}
    out["runs"][name] = {
        "wall_seconds": round(float(open(os.path.join(root, f"{name}.seconds")).read()), 1),
        "median_step_seconds": round(statistics.median(r["time/step"] for r in rows if "time/step" in r), 3),
        "summary": {k: v for k, v in summary.items() if k not in ("memory", "checkpoint", "metrics_file")},
        "evals": evals,
    }
json.dump(out, open(path, "w"), indent=2)
print(json.dumps({n: out["runs"][n]["summary"]["by_source"] for n in names}, indent=2))
PY
