#!/usr/bin/env bash
# Times the README's second command as a newcomer meets it (issue 38): `pip install -e ".[dev]" && pytest` in a fresh
# clone and a fresh virtualenv (what pip resolves today), beside LOAD busy processes standing in for other work.
#   bash lab/bench_test_command_cpu.sh [LOAD=0]
# Writes lab/results/first-run-cpu/tests-load<LOAD>[-TAG].json (the install and test seconds, pytest's last line,
# the resolved versions, the 1-minute load average sampled every 5 s) and prints it. The verl-backed bridge tests use
# the verl virtualenv that `.ci/run` builds (scripts/make_verl_venv.sh) when this machine has one, else they skip.
set -euo pipefail
load=${1:-0}
[ -d miniverl ] || { echo "run from the project root" >&2; exit 2; }
work=$(mktemp -d)
pids=()
cleanup() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
git clone -q . "$work/clone"
commit=$(git rev-parse --short HEAD)
for _ in $(seq 1 "$load"); do python3 -c "while True: pass" & pids+=($!); done
(while sleep 5; do cut -d' ' -f1 /proc/loadavg; done) > "$work/loadavg" & pids+=($!)
python3 -m venv "$work/venv"
cd "$work/clone"
start=$(date +%s.%N)
"$work/venv/bin/pip" install -q -e ".[dev]" > "$work/install.log" 2>&1
installed=$(date +%s.%N)
set +e
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider > "$work/pytest.log" 2>&1
rc=$?
set -e
done_=$(date +%s.%N)
versions=$("$work/venv/bin/python" -c "import torch, transformers, peft, ray, pytest; print(torch.__version__, transformers.__version__, peft.__version__, ray.__version__, pytest.__version__)")
cd - > /dev/null
mkdir -p lab/results/first-run-cpu
python3 - "$start" "$installed" "$done_" "$rc" "$work" "$load" "$commit" "$versions" "${TAG:-}" <<'PY'
import datetime, json, os, platform, sys
start, installed, done, rc, work, load, commit, versions, tag = sys.argv[1:]
samples = [float(x) for x in open(os.path.join(work, "loadavg")).read().split()]
tail = open(os.path.join(work, "pytest.log")).read().splitlines()
out = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": commit,
    "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
    "command": f"bash lab/bench_test_command_cpu.sh {load}",
    "versions (torch, transformers, peft, ray, pytest)": versions.split(),
    "busy_processes_beside": int(load),
    "load_average_1min": {"mean": round(sum(samples) / max(1, len(samples)), 2), "max": max(samples, default=None)},
    "install_seconds": round(float(installed) - float(start), 1),
    "pytest_seconds": round(float(done) - float(installed), 1),
    "pytest_exit_code": int(rc),
    "pytest_last_line": tail[-1] if tail else "",
    "failures": [line for line in tail if line.startswith("FAILED") or line.startswith("ERROR")],
}
path = f"lab/results/first-run-cpu/tests-load{load}{'-' + tag if tag else ''}.json"
json.dump(out, open(path, "w"), indent=2)
print(json.dumps(out, indent=2))
PY
