#!/usr/bin/env bash
# Issue 16's GPU half, on the device machine from the project root after staging the vllm + ray + extras bundle.
# Each argument is a step; results land in $OUT.
#   tests          the refresh GPU tests: the adapter read by another process through CUDA IPC
#                  (tests/test_policy_gpu.py), hf_cached's CUDA graphs following reloads with the served digest naming
#                  what they read (tests/rollout/test_hf_cached.py), and strict sync against a real bf16 vLLM engine,
#                  honest and stale (tests/step/test_sync_vllm_gpu.py)
#   measure-auto   lab/measurements/measure_refresh.py on the 4080 recipe's actors (16 GB caps, random 0.5B
#   measure-host   student with LoRA r32, 1.5B teacher): 32 refreshes with resources.weight_sync=auto (device) or
#                  host, at the default trainer.probe_every (16: 30 refreshes proven by the served digest alone, 2
#                  also probed)
#   probe-auto     the same with trainer.probe_every=1: every refresh also runs the probe (the proof before issue 16's
#                  served digest, now in one call per replica)
#   calls          lab/measurements/time_refresh_calls.py on the GPU: each refresh call in one process (no Ray
#                  round trips) at the 0.5B r32 shape: publish, serve (load + served digest), served_digest, and
#                  both probes
#   parts-auto     the same as measure-auto with 4 extra 640-token probe rows (as a run's on-policy rows) and each
#                  refresh call timed alone beside a no-op round trip (--parts): where the refresh's time goes
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
      timeout 300 python3 -m pytest -q -m gpu tests/test_policy_gpu.py tests/rollout/test_hf_cached.py tests/step/test_sync_vllm_gpu.py \
        -p no:cacheprovider 2>&1 | grep -v -e "Loading weights" > "$out/refresh_gpu_tests.log"
      tail -4 "$out/refresh_gpu_tests.log" ;;
    calls)
      models
      timeout 240 python3 lab/measurements/time_refresh_calls.py /tmp/m/student --device cuda --repeats 20 2>&1 \
        | grep -v -e "Loading weights" > "$out/calls.log"
      grep '^{' "$out/calls.log" | tee "$out/calls.json" ;;
    measure-*|parts-*|probe-*)
      sync=${step#*-}
      more=()
      [ "${step%%-*}" = parts ] && more=(--parts --extra-rows 4 --extra-tokens 640)
      [ "${step%%-*}" = probe ] && more=(trainer.probe_every=1)
      models
      timeout 240 python3 lab/measurements/measure_refresh.py --repeats 32 "${more[@]}" +experiment=gkd_4080 model.student.path=/tmp/m/student \
        model.teacher.path=/tmp/m/teacher data.train_files=[] resources.emulate_gpu_gib=16 resources.dashboard=false \
        tracking=disabled resources.weight_sync="$sync" 2>&1 | grep -v -e "Loading weights" -e "Writing model" \
        > "$out/$step.log"
      grep '^{' "$out/$step.log" | tee "$out/$step.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
