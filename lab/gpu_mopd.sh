#!/usr/bin/env bash
# Issue 18's GPU half: several NF4 teachers on one 16 GB card (lab/results/mopd-gpu.prereg.md), on the device
# machine from the project root after staging the ray + extras bundle (bitsandbytes for NF4). Each argument is a
# cell; results land in $OUT (flat names). One device call allows 10 minutes: run one or two cells per call.
#   single-bf16   one bf16 1.5B-shape teacher scores every row (the measured gkd_4080 layout, micro-batch 4)
#   single-nf4    one NF4 1.5B-shape teacher scores every row
#   two-nf4       two NF4 1.5B-shape teachers (different random weights), rows routed by data_source
#   four-nf4      four NF4 1.5B-shape teachers, rows of a prompt file with four data_sources (reverse-task rows
#                 written to /tmp/m/four_sources.jsonl, one source in turn per row) routed one teacher each
#   report        python -m lab.bench.e2e_report $OUT: the table of every cell run so far
# Every cell: random 0.5B-shape student (LoRA r32, bf16, hf_cached), built-in reverse+sort prompts (half the rows
# per source), 64 x 4 x 512 tokens, GKD top-64, resources.emulate_gpu_gib=16; nvidia-smi samples the whole
# device every 200 ms (<cell>_smi.csv; the processes, clocks and load beside it: lab/e2e_cell.sh).
# Two cells at once on an x2 machine: GPU=0 ... & GPU=1 ...
# $STEPS (default 12), $OVERRIDES and $TAG as in gpu_qlora.sh.
set -uo pipefail
out=${OUT:?set OUT}
gpu=${GPU:-0}
export CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
models() {
  [ -d /tmp/m/student ] || python3 scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/m/student >/dev/null
  [ -d /tmp/m/teacher_a ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --out /tmp/m/teacher_a >/dev/null
  [ -d /tmp/m/teacher_b ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --seed 1 --out /tmp/m/teacher_b >/dev/null
}
four_models() {  # two more teachers and the prompt file whose rows name four sources
  models
  [ -d /tmp/m/teacher_c ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --seed 2 --out /tmp/m/teacher_c >/dev/null
  [ -d /tmp/m/teacher_d ] || python3 scripts/make_random_model.py --shape qwen2.5-1.5b --seed 3 --out /tmp/m/teacher_d >/dev/null
  [ -f /tmp/m/four_sources.jsonl ] || python3 -c "
import json, random
rng = random.Random(0)
with open('/tmp/m/four_sources.jsonl', 'w') as f:
    for i in range(4096):
        s = ''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(3, 8)))
        f.write(json.dumps({'prompt': s + '>', 'answer': s[::-1], 'data_source': 'src_' + 'abcd'[i % 4]}) + chr(10))
"
}
. "$(dirname "$0")/e2e_cell.sh"
run_cell() {  # name, extra overrides...; $OVERRIDES (space-separated) come last, $TAG names the cell mopd-<cell>-<TAG>
  local name=$1${TAG:+-$TAG}; shift
  local more; read -r -a more <<< "${OVERRIDES:-}"
  e2e_cell "$name" "${STEPS:-12}" data.train_files=[] data.task=reverse+sort trainer.micro_batch_size=4 "$@" "${more[@]}"
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
    four-nf4)
      four_models
      run_cell "mopd-$cell" model.teacher.path=builtin:teacher data.train_files=[/tmp/m/four_sources.jsonl] data.chat_template=false \
        '+model.teachers={a:{path:/tmp/m/teacher_a,quantization:nf4},b:{path:/tmp/m/teacher_b,quantization:nf4},c:{path:/tmp/m/teacher_c,quantization:nf4},d:{path:/tmp/m/teacher_d,quantization:nf4}}' \
        '+model.teacher_by_source={src_a:a,src_b:b,src_c:c,src_d:d}' \
        '+reward.by_source={src_a:exact_match,src_b:exact_match,src_c:exact_match,src_d:exact_match}' ;;
    report) python3 -m lab.bench.e2e_report "$out" | tee "$out/mopd_report.md" ;;
    *) echo "unknown cell $cell" ;;
  esac
done
