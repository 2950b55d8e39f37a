# Sourced by the GPU scripts (gpu_qlora.sh, gpu_mopd.sh): one +experiment=gkd_4080 run under 16 GB caps with the
# random-init student at /tmp/m/student, nvidia-smi sampling the whole device every 200 ms (and each GPU process
# every second; the GPU's clocks and the host's load every 5 s), results into $out.
# $EXPERIMENT and $STUDENT change the recipe and the student's folder (gpu_qlora.sh recipe-7b).
# Needs $out and $gpu set by the caller. $CELL_TIMEOUT (seconds, default 540) bounds the run: raise it for a run
# started under setsid that outlasts one device call. Returns the run's exit status.
e2e_cell() {  # name, steps, extra overrides...
  local name=$1 steps=$2; shift 2
  nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$out/${name}_smi.csv" &
  local smi=$!
  # each GPU process's memory every second: the report names the actors by the pids in the log (e2e_report.py)
  nvidia-smi -i "$gpu" --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -l 1 > "$out/${name}_apps.csv" 2>/dev/null &
  local apps=$!
  # the GPU's SM clock, utilization, power and temperature, the host's 1-minute load and CPU count, every 5 s
  # (e2e_report.py HOST_COLUMNS): a step time that drifts while the memory stays flat is told apart by them
  ( while :; do
      echo "$(date +%s),$(nvidia-smi -i "$gpu" --query-gpu=clocks.sm,utilization.gpu,power.draw,temperature.gpu \
        --format=csv,noheader,nounits | tr -d ' '),$(cut -d' ' -f1 /proc/loadavg),$(nproc)"
      sleep 5
    done ) > "$out/${name}_host.csv" 2>/dev/null &
  local host=$!
  timeout "${CELL_TIMEOUT:-540}" python3 -m miniverl.main +experiment="${EXPERIMENT:-gkd_4080}" model.student.path="${STUDENT:-/tmp/m/student}" \
    data.eval_prompts=8 trainer.eval_every=0 trainer.total_steps="$steps" trainer.save_checkpoint=false \
    resources.emulate_gpu_gib=16 resources.dashboard=false tracking=disabled tracking.progress_bar=false \
    tracking.plots=false hydra.run.dir=/tmp/runs/$name "$@" 2>&1 \
    | grep -v -e "Loading weights" -e "Writing model shards" > "$out/$name.log"
  local rc=${PIPESTATUS[0]}  # the run's own exit status (a refused config exits 2), not grep's
  sleep 3; kill $smi $apps $host
  cp /tmp/runs/$name/metrics.jsonl "$out/${name}_metrics.jsonl" 2>/dev/null
  cp /tmp/runs/$name/summary.json "$out/${name}_summary.json" 2>/dev/null
  tail -4 "$out/$name.log"; echo "$name smi peak MiB: $(sort -n "$out/${name}_smi.csv" | tail -1)"
  [ "$rc" -eq 0 ] || echo "$name: the run exited with status $rc"
  return "$rc"
}
