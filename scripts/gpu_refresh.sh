#!/usr/bin/env bash
# Issue 16's GPU half, on the device machine from the project root after staging the vllm + ray + extras bundle.
# Each argument is a step; results land in $OUT.
#   tests          the refresh GPU tests: the adapter read by another process through CUDA IPC
#                  (tests/test_policy_gpu.py) and strict sync against a real bf16 vLLM engine, honest and stale
#                  (tests/step/test_sync_vllm_gpu.py)
#   measure-auto   scripts/measure_refresh.py on the 4080 recipe's actors (16 GB caps, random 0.5B student with
#   measure-host   LoRA r32, 1.5B teacher): 20 refreshes with resources.weight_sync=auto (device) or host
#   parts-auto     the same with 4 extra 640-token probe rows (as a run's on-policy rows) and each refresh call
#                  timed alone beside a no-op round trip (--parts): where the refresh's time goes
set -uo pipefail
out=${OUT:?set OUT}
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
models() {
  [ -d /tmp/m/student ] || python3 scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/m/student >/dev/null
  [ -d /tmp/m/teacher ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --out /tmp/m/teacher >/dev/null
}
for step in "$@"; do
  echo "== $step ($(date +%T))"
  case "$step" in
    tests)
      timeout 300 python3 -m pytest -q -m gpu tests/test_policy_gpu.py tests/step/test_sync_vllm_gpu.py \
        -p no:cacheprovider 2>&1 | grep -v -e "Loading weights" > "$out/refresh_gpu_tests.log"
      tail -4 "$out/refresh_gpu_tests.log" ;;
    measure-*|parts-*)
      sync=${step#*-}
      more=()
      [ "${step%%-*}" = parts ] && more=(--parts --extra-rows 4 --extra-tokens 640)
      models
      timeout 240 python3 scripts/measure_refresh.py --repeats 20 "${more[@]}" +experiment=gkd_4080 model.student.path=/tmp/m/student \
        model.teacher.path=/tmp/m/teacher data.train_files=[] resources.emulate_gpu_gib=16 resources.dashboard=false \
        tracking=disabled resources.weight_sync="$sync" 2>&1 | grep -v -e "Loading weights" -e "Writing model" \
        > "$out/$step.log"
      grep '^{' "$out/$step.log" | tee "$out/$step.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
