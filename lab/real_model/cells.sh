#!/usr/bin/env bash
# The real-model benchmark's four cells for one seed, side by side on one GPU (each run its own Ray instance and
# 16 GiB cap), so the cells of a seed share the machine's conditions; their step times are of a shared card.
#   OUT=DIR bash lab/real_model/cells.sh SEED [STEPS]        # writes DIR/runs/<cell>-s<SEED>/ and its .log
#   CELLS="self" OUT=DIR bash lab/real_model/cells.sh SEED   # only these cells (default: gkd pg_k1 grpo control)
# Cells (preregistered in lab/results/real-model/README.md): gkd and pg_k1 distil from the with-context teacher,
# grpo learns from the task reward alone (pg_k1 with teacher_coef 0), control is gkd with teacher = student (the
# same prompt: a zero signal). Seeds vary the LoRA init and the sampling; data.seed stays 0, so every run trains on
# the same prompts and is evaluated on the same 500 held-out problems. Added 2026-12-07 (lab/results/real-model/README.md
# addendum): self is gkd with the teacher as the student's own base in the learner (model.teacher.path=self, no
# second model); strong is gkd from the model at $STRONG_TEACHER (a trained run merged by python -m miniverl.merge),
# shown no demonstrations; the *_fp32 cells are the same in fp32.
set -uo pipefail
seed=${1:?give the seed}
steps=${2:-100}
out=${OUT:?set OUT}
mkdir -p "$out/runs"
common=(+experiment=smollm2_addition "trainer.total_steps=$steps" trainer.eval_every=20 "rollout.seed=$seed"
  "model.lora.init_seed=$seed" tracking=disabled resources.dashboard=false resources.emulate_gpu_gib=16)
declare -A extra=(
  [gkd]=""
  [pg_k1]="objective=pg_k1"
  [grpo]="objective=pg_k1 objective.teacher_coef=0 objective.reward_coef=1"
  [control]="data.teacher_demonstrations=0"
  [self]="model.teacher.path=self"
  [self_fp32]="model.teacher.path=self model.student.dtype=float32"
  [strong_fp32]="model.teacher.path=${STRONG_TEACHER:-unset} data.teacher_demonstrations=0 model.student.dtype=float32 model.teacher.dtype=float32"
  [grpo_fp32]="objective=pg_k1 objective.teacher_coef=0 objective.reward_coef=1 model.student.dtype=float32 model.teacher.dtype=float32"
)
cells=${CELLS:-gkd pg_k1 grpo control}
for cell in $cells; do
  # shellcheck disable=SC2086 # the cell's overrides are words
  python3 -m miniverl.main "${common[@]}" ${extra[$cell]} "hydra.run.dir=$out/runs/$cell-s$seed" \
    > "$out/runs/$cell-s$seed.log" 2>&1 &
  sleep 5  # Ray instances started at the same instant have timed out on a loaded machine
done
wait
rm -rf "$out"/runs/*-s"$seed"/checkpoints  # hundreds of MB a run: collect returns at most 16 MB
for cell in $cells; do
  echo "$cell-s$seed: $(grep -ao '"status": "[a-z]*"' "$out/runs/$cell-s$seed/summary.json" 2>/dev/null || echo no summary)"
done
