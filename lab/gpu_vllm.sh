#!/usr/bin/env bash
# Issue 8's GPU measurements, on the device machine from the project root after staging the vllm+ray+extras
# bundle. Each argument is a step; results land in $OUT (flat names). Steps:
#   tests          the vLLM backend's GPU tests (tests/rollout/test_vllm_gpu.py), one engine per pytest process
#   bench-NAME     python -m lab.bench +bench=NAME (lab/conf/bench/NAME.yaml)
#   e2e-BACKEND    GKD through Ray at real sizes (random Qwen2.5-0.5B student, 1.5B teacher) with
#                  rollout=BACKEND under 16 GB caps, $STEPS steps (default 48: with the conformance gate and the start and end evaluations, 51 refreshes);
#                  nvidia-smi sampled every 200 ms, and the run's metrics.jsonl (gpu/device_used_gib per step)
# Only 8 files come back from a device call's $OUT, and only what is there when the call ends: every step
# writes straight into $OUT (e2e: log, metrics.jsonl, summary.json per backend; the log ends with the
# nvidia-smi peak). Run two step lists at once on an x2 machine with GPU=0 / GPU=1 (one GPU each):
#   GPU=0 bash lab/gpu_vllm.sh tests bench-rollout-rl-sizes-hf-v4 & GPU=1 bash lab/gpu_vllm.sh bench-rollout-rl-sizes-vllm
set -uo pipefail
out=${OUT:?set OUT}
gpu=${GPU:-0}
steps=${STEPS:-48}
prompts=${PROMPTS:-16}  # e2e: prompt groups per step
samples=${N:-4}  # e2e: samples per prompt
m=/tmp/m$gpu  # one model folder per GPU: two step lists may run at once
export CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
models() {
  [ -d $m/student ] || python3 scripts/make_random_model.py --shape qwen2.5-0.5b --out $m/student >/dev/null
  [ -d $m/teacher ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --out $m/teacher >/dev/null
}
for step in "$@"; do
  echo "== gpu $gpu: $step ($(date +%T))"
  case "$step" in
    tests)
      for k in "adapter" "merged" "sleep"; do
        python3 -m pytest -q -x -m gpu tests/rollout/test_vllm_gpu.py -k "$k" -p no:cacheprovider -s 2>&1 \
          | grep -v -e "Loading weights" >> "$out/gpu${gpu}_vllm_tests.log"
      done
      tail -5 "$out/gpu${gpu}_vllm_tests.log" ;;
    bench-*)
      name=${step#bench-}
      python3 -m lab.bench "+bench=$name" "bench.output_dir=$out" "hydra.run.dir=/tmp/hydra-$name" 2>&1 \
        | grep --line-buffered -v -e "Loading weights" -e "Writing model shards" > "$out/$name.log"
      tail -12 "$out/$name.log" ;;
    e2e-*)
      backend=${step#e2e-}
      models
      nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "/tmp/e2e_${backend}_smi.csv" &
      smi=$!
      timeout ${E2E_TIMEOUT:-420} python3 -m miniverl.main +experiment=gkd model.student.path=$m/student \
        model.teacher.path=$m/teacher rollout=$backend resources.emulate_gpu_gib=16 resources.dashboard=false \
        trainer.total_steps=$steps trainer.eval_every=0 trainer.micro_batch_size=2 trainer.save_checkpoint=false \
        data.prompts_per_step=$prompts rollout.n=$samples rollout.max_new_tokens=256 data.eval_prompts=8 tracking=disabled \
        tracking.progress_bar=false hydra.run.dir=/tmp/runs/e2e-$backend 2>&1 | grep -v "Loading weights" \
        > "$out/e2e_$backend.log"
      sleep 3; kill $smi
      echo "after teardown: $(nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader)" >> "$out/e2e_$backend.log"
      cp /tmp/runs/e2e-$backend/metrics.jsonl "$out/e2e_${backend}_metrics.jsonl" 2>/dev/null
      cp /tmp/runs/e2e-$backend/summary.json "$out/e2e_${backend}_summary.json" 2>/dev/null
      echo "nvidia-smi peak MiB while running: $(sort -n "/tmp/e2e_${backend}_smi.csv" | tail -1)" >> "$out/e2e_$backend.log"
      tail -6 "$out/e2e_$backend.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
