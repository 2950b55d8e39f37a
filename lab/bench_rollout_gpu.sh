#!/usr/bin/env bash
# Issue 4's GPU measurements. Each argument is one step: `tests` (hf_cached's CUDA conformance tests) or a
# bench name from lab/conf/bench/. Everything lands in $OUT. Budget the device call: rollout-runtime-v3 takes
# about 7 minutes on an H200, the tests under a minute, rollout-hf-cached-variants about one.
#   bash lab/bench_rollout_gpu.sh tests rollout-runtime-v3      (repo root, hydra importable)
set -uo pipefail
OUT=${OUT:-outputs/bench-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for step in "${@:-tests}"; do
  if [ "$step" = tests ]; then
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
      python -m pytest -q -m gpu tests/rollout -p no:cacheprovider
    } 2>&1 | tee "$OUT/gpu_tests.log"
  else
    python -m lab.bench "+bench=$step" "bench.output_dir=$OUT" "hydra.run.dir=/tmp/hydra-$step" 2>&1 \
      | grep --line-buffered -v -e "Loading weights" -e "Writing model shards" | tee "$OUT/$step.log"
  fi
done
