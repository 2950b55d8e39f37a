#!/usr/bin/env bash
# GPU check of the spine (issue 2), run on the device machine from the project root:
#   1. the default command, unchanged (`+experiment=gkd`), on the GPU: bf16, fractional actors;
#   2. the same pipeline at real sizes (random-init Qwen2.5-0.5B student, 1.5B teacher) with every actor
#      capped as on a 16 GB card (resources.emulate_gpu_gib=16), a few steps.
# nvidia-smi samples total GPU memory every 200 ms during each run. Results go to $OUT (flat names).
set -uo pipefail
out=${OUT:?set OUT}
export PYTHONPATH=.:${PYTHONPATH:-}
smi() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$1" & echo $!; }

pid=$(smi "$out/smi_default.csv")
python3 -m miniverl.main +experiment=gkd model.cache_dir=.devcache tracking.progress_bar=false \
  hydra.run.dir=/tmp/runs/default 2>&1 | grep -v "Loading weights" | tee "$out/default.log"
kill "$pid"
cp /tmp/runs/default/metrics.jsonl "$out/default_metrics.jsonl"; cp /tmp/runs/default/summary.json "$out/default_summary.json"

python3 scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/m/student
python3 scripts/make_random_model.py --shape qwen2.5-1.5b --out /tmp/m/teacher
pid=$(smi "$out/smi_real.csv")
python3 -m miniverl.main +experiment=gkd model.student.path=/tmp/m/student model.teacher.path=/tmp/m/teacher \
  resources.emulate_gpu_gib=16 trainer.total_steps=4 trainer.eval_every=0 trainer.micro_batch_size=2 \
  data.prompts_per_step=16 rollout.n=4 rollout.max_new_tokens=256 data.eval_prompts=8 tracking=disabled \
  tracking.progress_bar=false hydra.run.dir=/tmp/runs/real 2>&1 | grep -v "Loading weights" | tee "$out/real.log"
kill "$pid"
cp /tmp/runs/real/metrics.jsonl "$out/real_metrics.jsonl"; cp /tmp/runs/real/summary.json "$out/real_summary.json"
for f in "$out"/smi_*.csv; do echo "$f peak MiB: $(sort -n "$f" | tail -1)"; done
