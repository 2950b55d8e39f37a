#!/usr/bin/env bash
# A stronger teacher built from the real model by the project's own tools: GRPO on the task reward (fp32, the cell
# grpo_fp32 of cells.sh, seed 0, STEPS steps), its final checkpoint merged into a model directory by
# `python -m miniverl.merge` (build.json beside the weights), then gkd from it to the zero-shot student on 3 seeds
# (cells.sh cell strong_fp32: no demonstrations). lab/results/real-model/README.md, the 2026-12-07 addendum.
#   OUT=DIR bash lab/real_model/strong_teacher.sh [STEPS] [TEACHER_DIR]
set -uo pipefail
steps=${1:-100}
teacher=${2:-/tmp/strong-teacher}
out=${OUT:?set OUT}
here=$(dirname "$0")
mkdir -p "$out/runs"
run="$out/runs/teacher_grpo_fp32"
python3 -m miniverl.main +experiment=smollm2_addition "trainer.total_steps=$steps" trainer.eval_every=20 \
  rollout.seed=0 model.lora.init_seed=0 tracking=disabled resources.dashboard=false resources.emulate_gpu_gib=16 \
  objective=pg_k1 objective.teacher_coef=0 objective.reward_coef=1 model.student.dtype=float32 \
  model.teacher.dtype=float32 "hydra.run.dir=$run" > "$run.log" 2>&1
echo "teacher run: $(grep -ao '"status": "[a-z]*"' "$run/summary.json" 2>/dev/null || echo no summary)"
rm -rf "$teacher"
python3 -m miniverl.merge "$run" "$teacher" > "$out/runs/teacher_merge.log" 2>&1 || { echo "merge failed"; exit 1; }
cp "$teacher/build.json" "$out/runs/teacher_build.json"
rm -rf "$run/checkpoints"  # collect returns at most 16 MB
for seed in 0 1 2; do
  STRONG_TEACHER=$teacher CELLS=strong_fp32 bash "$here/cells.sh" "$seed" "$steps" &
  sleep 5
done
wait
