#!/usr/bin/env bash
# Scale-out measurement (issue 5) for a multi-GPU device kind (nvidia-h200-x2 or larger), from the
# project root after staging the ray+extras bundle: the same strict-sync workload at resources.gpus=1
# and =2 (random-init Qwen2.5-0.5B-shaped student and teacher, a 16 GB share per GPU, hf_cached rollout).
# Compare time/step and rollout_tokens_per_s in $OUT/gpus{1,2}_metrics.jsonl: the scaling ratio.
set -uo pipefail
out=${OUT:?set OUT}
steps=${STEPS:-3}
export PYTHONPATH=.:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c 'import torch; print("GPUs:", torch.cuda.device_count())' | tee "$out/gpus.txt"
python3 scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/m/student --seed 0 >/dev/null
python3 scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/m/teacher --seed 1 >/dev/null
for g in 1 2; do
  timeout 170 python3 -m miniverl.main +experiment=gkd model.student.path=/tmp/m/student \
    model.teacher.path=/tmp/m/teacher rollout=hf_cached resources.gpus=$g resources.emulate_gpu_gib=16 \
    trainer.total_steps=$steps trainer.eval_every=0 trainer.micro_batch_size=4 data.prompts_per_step=16 rollout.n=4 \
    rollout.max_new_tokens=128 data.eval_prompts=4 tracking=disabled tracking.progress_bar=false \
    hydra.run.dir=/tmp/runs/gpus$g 2>&1 | grep -v "Loading weights" | tail -40 > "$out/gpus$g.log"
  cp /tmp/runs/gpus$g/metrics.jsonl "$out/gpus${g}_metrics.jsonl" 2>/dev/null
  tail -8 "$out/gpus$g.log"
done
