#!/usr/bin/env bash
# Times the README's first command as a newcomer meets it (issue 38): `python -m miniverl.main +experiment=NAME` from
# a fresh clone into an EMPTY model cache (the built-in models are copied from the shipped ones, or built where a recipe
# has none), optionally beside LOAD busy processes standing in for other work on the machine, and with BUILD=1 (the
# default) the build of the default task's two models from scratch (`scripts/build_models.py --fresh`) under the
# same load.
#   bash lab/bench_first_run_cpu.sh [NAME=gkd] [LOAD=0] [EXTRA_OVERRIDES...]
# Writes lab/results/first-run-cpu/NAME-load<LOAD>[-TAG].json (TAG=... in the environment names a variant) and
# prints it. The load: LOAD copies of `python3 -c "while True: pass"` (each keeps one core busy), started before and
# killed after; the JSON records the 1-minute load average sampled every 5 s while the run went.
set -euo pipefail
name=${1:-gkd}
load=${2:-0}
shift $(( $# > 2 ? 2 : $# ))
[ -d miniverl ] || { echo "run from the project root" >&2; exit 2; }
work=$(mktemp -d)
pids=()
cleanup() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
git clone -q . "$work/clone"  # the committed tree, as a fresh clone has it
for _ in $(seq 1 "$load"); do python3 -c "while True: pass" & pids+=($!); done
(while sleep 5; do cut -d' ' -f1 /proc/loadavg; done) > "$work/loadavg" & pids+=($!)
cd "$work/clone"
start=$(date +%s.%N)
python3 -m miniverl.main +experiment="$name" model.cache_dir="$work/cache" tracking.progress_bar=false \
  hydra.run.dir="$work/run" "$@" 2>&1 | grep -v "Loading weights" | tee "$work/run.log"
ran=$(date +%s.%N)
[ "${BUILD:-1}" = 0 ] || PYTHONPATH=. python3 scripts/build_models.py --fresh --cache-dir "$work/scratch" > "$work/build.log" 2>&1
built=$(date +%s.%N)
cd - > /dev/null
mkdir -p lab/results/first-run-cpu
python3 - "$start" "$ran" "$built" "$work" "$name" "$load" "${TAG:-}" "$*" <<'PY'
import datetime, json, os, platform, statistics, subprocess, sys
import torch, transformers, ray
start, ran, built, work, name, load, tag, extra = sys.argv[1:]
summary = json.load(open(os.path.join(work, "run", "summary.json")))
samples = [float(x) for x in open(os.path.join(work, "loadavg")).read().split()]
log = open(os.path.join(work, "run.log")).read().splitlines()
out = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
    "versions": {"python": platform.python_version(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "ray": ray.__version__},
    "command": f"bash lab/bench_first_run_cpu.sh {name} {load} {extra}".strip(),
    "busy_processes_beside": int(load),
    "load_average_1min": {"mean": round(sum(samples) / max(1, len(samples)), 2), "max": max(samples, default=None)},
    "first_run_seconds": round(float(ran) - float(start), 1),
    "model_lines": [line for line in log if "built-in" in line or "built " in line],
    "build_from_scratch_seconds": round(float(built) - float(ran), 1) if os.path.exists(os.path.join(work, "build.log")) else None,
    "build_log_tail": open(os.path.join(work, "build.log")).read().splitlines()[-4:] if os.path.exists(os.path.join(work, "build.log")) else [],
    "summary": {k: summary.get(k) for k in ("status", "steps", "wall_seconds", "start_reverse_kl", "end_reverse_kl",
                                            "start_accuracy", "end_accuracy")},
}
path = f"lab/results/first-run-cpu/{name}-load{load}{'-' + tag if tag else ''}.json"
rows = [json.loads(line) for line in open(os.path.join(work, "run", "metrics.jsonl"))]
keys = ("time/step", "time/generate", "time/score", "time/update", "time/refresh")
out["median_seconds_per_step"] = {k: statistics.median_high(r[k] for r in rows if k in r)
                                  for k in keys if any(k in r for r in rows)}
json.dump(out, open(path, "w"), indent=2)
print(json.dumps(out, indent=2))
PY
