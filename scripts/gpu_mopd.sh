#!/usr/bin/env bash
# Issue 18's GPU half: several NF4 teachers on one 16 GB card (docs/benchmarks/mopd-gpu.prereg.md), on the device
# machine from the project root after staging the ray + extras bundle (bitsandbytes for NF4). Each argument is a
# cell; results land in $OUT (flat names). One device call allows 10 minutes: run one or two cells per call.
#   single-bf16   one bf16 1.5B-shape teacher scores every row (the measured gkd_4080 layout, micro-batch 4)
#   single-nf4    one NF4 1.5B-shape teacher scores every row
#   two-nf4       two NF4 1.5B-shape teachers (different random weights), rows routed by data_source
#   report        python -m miniverl.bench.e2e_report $OUT: the table of every cell run so far
# Every cell: random 0.5B-shape student (LoRA r32, bf16, hf_cached), built-in reverse+sort prompts (half the rows
# per source), 64 x 4 x 512 tokens, GKD top-64, resources.emulate_gpu_gib=16; nvidia-smi samples the whole
# device every 200 ms (<cell>_smi.csv). Two cells at once on an x2 machine: GPU=0 ... & GPU=1 ...
set -uo pipefail
out=${OUT:?set OUT}
gpu=${GPU:-0}
export CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
models() {
  [ -d /tmp/m/student ] || python3 scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/m/student >/dev/null
  [ -d /tmp/m/teacher_a ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --out /tmp/m/teacher_a >/dev/null
  [ -d /tmp/m/teacher_b ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --seed 1 --out /tmp/m/teacher_b >/dev/null
}
. "$(dirname "$0")/e2e_cell.sh"
run_cell() {  # name, extra overrides...
  local name=$1; shift
  e2e_cell "$name" "${STEPS:-12}" data.train_files=[] data.task=reverse+sort trainer.micro_batch_size=4 "$@"
}
for cell in "$@"; do
  echo "== gpu $gpu: $cell ($(date +%T))"
  case "$cell" in
    single-bf16) models; run_cell "mopd-$cell" model.teacher.path=/tmp/m/teacher_a ;;
    single-nf4) models; run_cell "mopd-$cell" model.teacher.path=/tmp/m/teacher_a model.teacher.quantization=nf4 ;;
    two-nf4)
      models
      # model.teacher goes back to its default: with named teachers it is unused (and refused when set)
      run_cell "mopd-$cell" model.teacher.path=builtin:teacher \
        '+model.teachers={reverse:{path:/tmp/m/teacher_a,quantization:nf4},sort:{path:/tmp/m/teacher_b,quantization:nf4}}' \
        '+model.teacher_by_source={reverse:reverse,sort:sort}' ;;
    report) python3 -m miniverl.bench.e2e_report "$out" | tee "$out/mopd_report.md" ;;
    *) echo "unknown cell $cell" ;;
  esac
done
