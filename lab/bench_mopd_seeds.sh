#!/usr/bin/env bash
# Multi-teacher distillation over seeds on the CPU (issue 35): +experiment=mopd once per seed (data.seed, rollout.seed
# and model.lora.init_seed set to it: other prompts, other held-out prompts, other samples, another adapter init),
# then each task's start -> end greedy accuracy and reverse KL to its own teacher, the mean gain over seeds and its
# standard error. Writes lab/results/mopd-cpu-seeds.json.
# Usage: bash lab/bench_mopd_seeds.sh [seed ...]   (default: 1 2 3; seed 0 is lab/results/mopd-cpu.md's run)
# The baselines: LABEL=<name> RUN="<experiment and overrides>" runs those instead and writes mopd-cpu-seeds-<name>.json
# (docs/multi_teacher.md gives the commands).
set -euo pipefail
seeds=("$@"); [ ${#seeds[@]} -gt 0 ] || seeds=(1 2 3)
label=${LABEL:-mopd}
read -r -a run <<< "${RUN:-+experiment=mopd}"
root=$(mktemp -d)
for s in "${seeds[@]}"; do
  start=$(date +%s)
  python3 -m miniverl.main "${run[@]}" data.seed="$s" rollout.seed="$s" model.lora.init_seed="$s" \
    tracking=disabled tracking.progress_bar=false tracking.plots=false trainer.save_checkpoint=false \
    hydra.run.dir="$root/seed$s" 2>&1 | grep -v -e "Loading weights" -e "Writing model shards" > "$root/seed$s.log"
  echo "seed $s: $(( $(date +%s) - start )) s"
done
python3 - "$root" "$label" "${run[*]}" "${seeds[@]}" <<'PY'
import json, math, os, platform, statistics, sys
import torch, transformers
root, label, run, seeds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
runs = {s: json.load(open(os.path.join(root, f"seed{s}", "summary.json")))["by_source"] for s in seeds}
out = {
    "date": __import__("datetime").date.today().isoformat(),
    "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
    "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    "command": (f"LABEL={label} RUN='{run}' " if label != "mopd" else "") + "bash lab/bench_mopd_seeds.sh " + " ".join(seeds),
    "runs": runs,
    "tasks": {},
}
for task in next(iter(runs.values())):
    gains = [r[task]["end_accuracy"] - r[task]["start_accuracy"] for r in runs.values()]
    kl = [r[task]["end_reverse_kl"] - r[task]["start_reverse_kl"] for r in runs.values()]
    se = statistics.stdev(gains) / math.sqrt(len(gains)) if len(gains) > 1 else float("nan")
    out["tasks"][task] = {
        "accuracy_gains": gains, "mean_gain": statistics.mean(gains), "standard_error": se,
        "rises_on_every_seed": all(g > 0 for g in gains), "reverse_kl_changes": kl,
    }
path = "lab/results/mopd-cpu-seeds.json" if label == "mopd" else f"lab/results/mopd-cpu-seeds-{label}.json"
json.dump(out, open(path, "w"), indent=2)
print(json.dumps(out["tasks"], indent=2))
PY
