#!/usr/bin/env bash
# gkd on the real model alone on the GPU for STEPS steps under the 16 GiB caps, with nvidia-smi sampled every 0.5 s:
# the step time by phase and the whole-card memory peak of the recipe.
#   OUT=DIR bash lab/real_model/alone.sh [STEPS [NAME [OVERRIDE...]]]   # writes DIR/NAME/ (default: alone)
# e.g. `alone.sh 30 alone-self model.teacher.path=self`: the teacher as the student's base, no second model.
set -uo pipefail
steps=${1:-30}
name=${2:-alone}
shift 2 2>/dev/null || shift $#
out=${OUT:?set OUT}
mkdir -p "$out/$name"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$out/$name/nvidia-smi.csv" &
smi=$!
python3 -m miniverl.main +experiment=smollm2_addition "trainer.total_steps=$steps" trainer.eval_every=0 \
  data.eval_prompts=100 tracking=disabled resources.emulate_gpu_gib=16 "hydra.run.dir=$out/$name/run" "$@" \
  > "$out/$name/run.log" 2>&1
kill $smi
rm -rf "$out/$name/run/checkpoints"  # collect returns at most 16 MB
echo "$name whole-card peak: $(sort -t, -k2 -n "$out/$name/nvidia-smi.csv" | tail -1 | cut -d, -f2) MiB"
