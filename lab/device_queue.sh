#!/usr/bin/env bash
# A device session's GPU work as one queue that outlasts a single device call (10 minutes each), so the machine
# never idles between cells. From the project root on the device machine, after staging the bundles:
#
#   bash lab/device_queue.sh start QUEUE_FILE...  # returns at once; the files' commands run in order under setsid
#   bash lab/device_queue.sh check QUEUE_FILE...  # anywhere: what start would refuse (see below), nothing run
#   bash lab/device_queue.sh collect SECONDS      # packs results into $OUT/res.tgz every 20 s, until the
#                                                     # queue is done or SECONDS have passed (one call's worth;
#                                                     # $QUEUE_POLL_S sets the 20 s)
#
# QUEUE_FILE: one shell command per line, run in order with OUT=$QUEUE_ROOT/res (blank lines and # comments
# skipped), e.g. `CELL_TIMEOUT=1300 STEPS=52 bash lab/gpu_qlora.sh cell-gkd-bf16-hf_cached`. The queue runs
# from a private copy of the tree ($QUEUE_ROOT/tree): later device calls re-copy the working tree, and must not
# change the code under a running cell. Each command's start, exit status and time go to res/queue.log, which
# ends with ALL_DONE. A failing command does not stop the queue. Session 8 ran its whole GPU plan this way
# (lab/results/staleness-gpu/s8/queue.log). $QUEUE_ROOT defaults to /tmp/queue. `start` (and `check`) refuse a
# file with a line bash cannot read, or one that sets PYTHONPATH without keeping $PYTHONPATH (the staged bundles'
# site), before anything runs.
set -uo pipefail
root=${QUEUE_ROOT:-/tmp/queue}
res=$root/res
finished() { grep -q ALL_DONE "$res/queue.log" 2>/dev/null; }  # the runner's last line
check_queues() {  # each line bash can read, none dropping the staged site: a bad line would cost its cell's device time
  local queue n cmd
  for queue in "$@"; do
    [ -f "$queue" ] || { echo "no queue file $queue" >&2; return 2; }
    n=0
    while IFS= read -r cmd || [ -n "$cmd" ]; do
      n=$((n + 1))
      case "$cmd" in ''|'#'*) continue ;; esac
      bash -n -c "$cmd" 2>/dev/null || { echo "$queue line $n is not a shell command bash can read: $cmd" >&2; return 2; }
      # `PYTHONPATH=. cmd` drops the staged bundles' site (session 25 lost its SGLang GPU tests to it)
      if grep -qE '(^|[[:space:];(])PYTHONPATH=' <<< "$cmd" \
        && ! grep -qE '(^|[[:space:];(])PYTHONPATH=[^[:space:];]*[$][{]?PYTHONPATH' <<< "$cmd"; then
        echo "$queue line $n sets PYTHONPATH without the staged site's: write PYTHONPATH=...:\$PYTHONPATH" >&2
        return 2
      fi
    done < "$queue"
  done
}
case "${1:-}" in
  start)
    shift
    [ $# -gt 0 ] || { echo "give the queue file(s): bash lab/device_queue.sh start QUEUE_FILE..." >&2; exit 2; }
    [ -d miniverl ] || { echo "run from the project root" >&2; exit 2; }
    check_queues "$@" || exit 2
    if [ -f "$res/queue.log" ] && ! finished; then
      echo "a queue is still running ($res/queue.log); wait for it with collect" >&2; exit 2
    fi
    rm -rf "$root/tree" "$res"; mkdir -p "$root/tree" "$res"
    tar --exclude=./.devbundle --exclude=./.git -cf - . | tar -xf - -C "$root/tree"
    for queue in "$@"; do cat "$queue"; echo; done > "$res/queue.txt"  # a file without a final newline stays whole
    count=$(grep -cvE '^\s*(#|$)' "$res/queue.txt")
    echo "== queued $count commands from $* ($(date +%T))" > "$res/queue.log"  # before start returns
    runner=$(cat <<'EOF'
cd "$1/tree"; res=$1/res
[ -f /tmp/site/env.sh ] && . /tmp/site/env.sh
export OUT=$res PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
log() { echo "== $* ($(date +%T))" >> "$res/queue.log"; }
log start
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$res/queue.log" 2>&1
while IFS= read -r cmd || [ -n "$cmd" ]; do
  case "$cmd" in ''|'#'*) continue ;; esac
  log "run: $cmd"
  bash -c "$cmd" >> "$res/queue.log" 2>&1 < /dev/null  # a command reading stdin must not eat the queue
  log "rc $?"
done < "$res/queue.txt"
log ALL_DONE
EOF
)
    setsid nohup bash -c "$runner" queue "$root" > "$root/runner.log" 2>&1 < /dev/null &
    echo "queue started: $count commands, log $res/queue.log" ;;
  check)  # here, before the device call: what start would refuse
    shift
    [ $# -gt 0 ] || { echo "give the queue file(s): bash lab/device_queue.sh check QUEUE_FILE..." >&2; exit 2; }
    check_queues "$@" || exit 2
    echo "ok: $* (every line readable, PYTHONPATH kept)" ;;
  collect)
    out=${OUT:?set OUT (the device call sets it)}
    seconds=${2:?give the seconds to wait: bash lab/device_queue.sh collect 560}
    [ -d "$res" ] || { echo "no queue has run here ($res missing): start one first" >&2; exit 2; }
    end=$(( $(date +%s) + seconds ))
    pack() {  # with the metrics a cell still running has written so far and its plan (lab/e2e_cell.sh runs in
      # /tmp/runs): a cell the device's time cuts short is reported from them (bench/e2e_report.py reads ../runs/)
      local partial=()
      [ -d /tmp/runs ] && mapfile -t partial < <(cd /tmp && ls runs/*/metrics.jsonl runs/*/plan.json 2>/dev/null)
      tar -czf "$out/res.tgz.tmp" -C "$root" res ${partial[@]+-C /tmp "${partial[@]}"} 2>/dev/null \
        && mv "$out/res.tgz.tmp" "$out/res.tgz"
    }
    while [ "$(date +%s)" -lt "$end" ]; do
      pack
      finished && break
      sleep "${QUEUE_POLL_S:-20}"
    done
    pack
    finished && echo "queue done" || echo "queue still running"
    grep '^== ' "$res/queue.log" | tail -6 ;;
  *)
    echo "usage: bash lab/device_queue.sh start QUEUE_FILE... | collect SECONDS | check QUEUE_FILE..." >&2; exit 2 ;;
esac
