#!/usr/bin/env bash
# Strict sync against one-step-stale rollouts on the CPU (issue 19's CPU target): the default GKD run,
#   python -m miniverl.main +experiment=gkd trainer.staleness=0|1
# same seeds, one after the other (never in parallel: they share the machine's cores), with the built-in
# models built once into a shared cache first. Writes lab/results/staleness-cpu.json (the .md is
# written by hand from it). Usage: bash lab/bench_staleness_cpu.sh [extra overrides...]
set -euo pipefail
cache=${MINIVERL_BENCH_CACHE:-$(mktemp -d)}
out=$(mktemp -d)
python3 scripts/build_models.py --cache-dir "$cache" > "$out/build.log"
for s in 0 1; do
  start=$(date +%s.%N)
  python3 -m miniverl.main +experiment=gkd trainer.staleness=$s model.cache_dir="$cache" tracking.progress_bar=false \
    hydra.run.dir="$out/staleness$s" "$@" 2>&1 | grep -v "Loading weights" > "$out/staleness$s.log"
  echo "$start $(date +%s.%N)" > "$out/staleness$s.wall"
  tail -3 "$out/staleness$s.log"
done
python3 lab/measurements/staleness_report.py "$out" "$*"
