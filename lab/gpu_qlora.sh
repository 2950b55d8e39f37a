#!/usr/bin/env bash
# Issue 9's GPU half: the preregistered 16 GB workload (lab/results/qlora-4080.prereg.md), on the device
# machine from the project root after staging the vllm + ray + extras + trl bundles. Each argument is a step;
# results land in $OUT (flat names). One device call allows 10 minutes: run one or two steps per call.
#   tests               the GPU tests of issue 9 (tests/models/test_nf4_gpu.py: double quantization, chunked = direct
#                       on NF4, hf_reference and vLLM bitsandbytes serving the learner's base; test_learner_memory_gpu.py:
#                       the learner's peak at the real vocabulary, direct vs chunked)
#   cell-OBJ-QUANT-BACKEND   one miniverl.main run of +experiment=gkd_4080 under 16 GB caps:
#                       OBJ gkd|pg_k1, QUANT bf16|nf4 (student and teacher), BACKEND hf_cached|vllm;
#                       $STEPS steps (default: 52 for the two headline cells, 12 for the others); $OVERRIDES (space-
#                       separated Hydra overrides) are added to the cell and $TAG, when set, is appended to its name
#                       (e.g. TAG=stale1 OVERRIDES=trainer.staleness=1 -> cell-gkd-bf16-hf_cached-stale1)
#   recipe-7b           +experiment=gkd_4080_7b (issue 35): a random-init 1.5B-shape student and 7B-shape teacher
#                       (written to /tmp/m/student-1.5b and /tmp/m/teacher-7b first, the 7B on the GPU), $STEPS
#                       steps (default 52), $OVERRIDES added, named recipe-7b${TAG:+-$TAG}
#   compare             miniVERL and TRL's GKDTrainer on the comparison shape (16 prompts x 1 x 512 tokens,
#                       LoRA r32, beta 0.5, on-policy), one after the other in this call
#   report              python -m lab.bench.e2e_report $OUT: the table of every cell run so far
#   mps-on / mps-off    start / stop the CUDA Multi-Process Service for the cells between them (its kernels of
#                       separate processes run at once instead of time-slicing; says so when the machine lacks it)
# nvidia-smi samples the whole device every 200 ms during each run (<cell>_smi.csv), each GPU process every second
# (<cell>_apps.csv), the GPU's clocks and the host's load every 5 s (<cell>_host.csv): lab/e2e_cell.sh.
# Two cells at once on an x2 machine: GPU=0 bash lab/gpu_qlora.sh cell-... & GPU=1 bash lab/gpu_qlora.sh cell-...
set -uo pipefail
out=${OUT:?set OUT}
gpu=${GPU:-0}
export CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
HEADLINE="cell-gkd-bf16-hf_cached cell-pg_k1-nf4-vllm"
models() {
  [ -d /tmp/m/student ] || python3 scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/m/student >/dev/null
  [ -d /tmp/m/teacher ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --out /tmp/m/teacher >/dev/null
}
. "$(dirname "$0")/e2e_cell.sh"
miniverl() {  # name, steps, extra overrides...
  local name=$1 steps=$2; shift 2
  e2e_cell "$name" "$steps" model.teacher.path=/tmp/m/teacher data.train_files=[] "$@"
}
status=0  # the worst exit status of the steps: a queue's log shows a refused or failed cell as non-zero
for step in "$@"; do
  echo "== gpu $gpu: $step ($(date +%T))"
  case "$step" in
    tests)
      python3 -m pytest -q -m gpu tests/models/test_nf4_gpu.py tests/models/test_learner_memory_gpu.py -p no:cacheprovider -s 2>&1 \
        | grep -v -e "Loading weights" > "$out/nf4_gpu_tests.log"
      tail -5 "$out/nf4_gpu_tests.log" ;;
    cell-*)
      IFS=- read -r _ obj quant backend <<< "$step"
      models
      case " $HEADLINE " in *" $step "*) default_steps=52 ;; *) default_steps=12 ;; esac
      extra=("objective=$obj" "rollout=$backend")
      [ "$quant" = nf4 ] && extra+=(model.student.quantization=nf4 model.teacher.quantization=nf4)
      read -r -a more <<< "${OVERRIDES:-}"
      miniverl "$step${TAG:+-$TAG}" "${STEPS:-$default_steps}" "${extra[@]}" "${more[@]}" || status=$? ;;
    recipe-7b)
      [ -d /tmp/m/student-1.5b ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --out /tmp/m/student-1.5b >/dev/null
      [ -d /tmp/m/teacher-7b ] || python3 scripts/make_random_model.py --shape qwen2.5-7b --device cuda --out /tmp/m/teacher-7b >/dev/null
      read -r -a more <<< "${OVERRIDES:-}"
      EXPERIMENT=gkd_4080_7b STUDENT=/tmp/m/student-1.5b e2e_cell "$step${TAG:+-$TAG}" "${STEPS:-52}" \
        model.teacher.path=/tmp/m/teacher-7b data.train_files=[] "${more[@]}" || status=$? ;;
    compare)
      models
      miniverl compare-miniverl 12 data.prompts_per_step=16 rollout.n=1 trainer.micro_batch_size=16
      nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$out/compare-trl_smi.csv" &
      smi=$!
      timeout 400 python3 lab/measurements/trl_gkd_compare.py --student /tmp/m/student --teacher /tmp/m/teacher \
        --out "$out/compare-trl.json" --prompts 16 --samples 1 --max-new-tokens 512 --micro-batch 16 \
        --steps 3 --lora-rank 32 --beta 0.5 2>&1 | grep -v "Loading weights" > "$out/compare-trl.log"
      sleep 3; kill $smi
      tail -3 "$out/compare-trl.log"; echo "trl smi peak MiB: $(sort -n "$out/compare-trl_smi.csv" | tail -1)" ;;
    mps-on)
      if ! command -v nvidia-cuda-mps-control >/dev/null; then echo "no nvidia-cuda-mps-control here: MPS not run"; continue; fi
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && echo "MPS daemon started" ;;
    mps-off)
      echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
    report)
      python3 -m lab.bench.e2e_report "$out" | tee "$out/e2e_report.md" ;;
    *) echo "unknown step $step" ;;
  esac
done
exit $status
