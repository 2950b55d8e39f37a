"""Reading end-to-end runs (metrics.jsonl + nvidia-smi samples) into the numbers a preregistered workload
promises: step split, memory slope over refreshes, whole-device peak (and each GPU process's, named by its actor,
where <cell>_apps.csv holds nvidia-smi's per-process samples), the sampler/learner gate, and the memory plan the run
printed against the peaks it measured (where <cell>_summary.json records it), and the machine under it (where
<cell>_host.csv holds the GPU's clocks and the host's load: a step time that drifts while the memory stays flat is
told apart by them).

    python -m lab.bench.e2e_report OUT_DIR      # every <cell>_metrics.jsonl in OUT_DIR -> a table

A cell cut short (the device's time ran out under it: lab/device_queue.sh) never copied its files into OUT_DIR;
what the queue's collect packed of its run directory, OUT_DIR/../runs/<cell>/ (metrics.jsonl so far, plan.json), is
read instead, and the cell is marked "cut short".

Used by lab/gpu_qlora.sh (lab/results/qlora-4080.prereg.md fixes the cells and the thresholds).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

PHASES = ("refresh", "generate", "score", "update")
WARMUP_STEPS = 2  # engine/graph capture and allocator growth: excluded from the memory slope and medians
# The preregistered conformance gate for PG-k1 on a sampler other than the learner (DESIGN.md: vLLM NF4
# against the NF4 learner measured mean 0.10 nats, no ratio outside [0.5, 2]; bf16 engine vs NF4 learner 1.66).
GATE_MAX_GAP_MEAN = 0.2  # nats per token, mean over the run
GATE_MAX_CLIPPED = 0.01  # fraction of tokens with importance ratio above the cap (2), on every step
SLOPE_FLAT_GIB = 0.005  # |memory slope| at or below this (GiB per refresh) counts as flat: 50 steps move < 0.25 GiB


def memory_slope(steps: list[float], values: list[float]) -> float:
    """Least-squares slope of `values` over `steps` (GiB per step); 0 for fewer than two points."""
    if len(steps) < 2:
        return 0.0
    mx, my = statistics.fmean(steps), statistics.fmean(values)
    var = sum((x - mx) ** 2 for x in steps)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(steps, values)) / var


def training_steps(rows: list[dict]) -> list[dict]:
    """A run's metrics.jsonl rows of training steps: step >= 1 with a time/step (not the step-0 or eval rows)."""
    return [r for r in rows if r.get("step", 0) >= 1 and "time/step" in r]


def summarize(rows: list[dict], smi_mib: list[float]) -> dict:
    """One run: its training steps (training_steps) and the nvidia-smi samples taken during it."""
    steps = training_steps(rows)
    timed = steps[WARMUP_STEPS:] or steps
    out: dict = {"steps": len(steps)}
    if not steps:
        return out | {"smi_peak_gib": max(smi_mib, default=0.0) / 1024}
    out["step_s"] = statistics.median(r["time/step"] for r in timed)
    for phase in PHASES:
        out[f"{phase}_s"] = statistics.median(r[f"time/{phase}"] for r in timed)
    mem = [(r["step"], r["gpu/device_used_gib"]) for r in timed if "gpu/device_used_gib" in r]
    out["memory_slope_gib_per_step"] = memory_slope([s for s, _ in mem], [m for _, m in mem])
    out["memory_flat"] = abs(out["memory_slope_gib_per_step"]) <= SLOPE_FLAT_GIB
    # the same slope over the second half of those steps: the allocator grows in steps as a longer row or forward
    # first shows up (MOPD run 2: +0.38 GiB at step 17, then flat to step 52), which the whole run's slope cannot
    # tell from a leak; reported beside the preregistered verdict, not in place of it
    late = mem[len(mem) // 2 :]
    out["memory_late_slope_gib_per_step"] = memory_slope([s for s, _ in late], [m for _, m in late])
    out["smi_peak_gib"] = max(smi_mib, default=0.0) / 1024
    gaps = [r["sampler_gap_mean"] for r in steps if "sampler_gap_mean" in r]
    clipped = [r["clipped_ratio_frac"] for r in steps if "clipped_ratio_frac" in r]
    out["sampler_gap_mean"] = statistics.fmean(gaps) if gaps else None
    out["clipped_ratio_max"] = max(clipped) if clipped else None
    out["gate_passed"] = (
        None
        if not gaps or not clipped
        else out["sampler_gap_mean"] <= GATE_MAX_GAP_MEAN and out["clipped_ratio_max"] <= GATE_MAX_CLIPPED
    )
    return out


# Ray prefixes an actor's output with its class and pid: "(ScorerWorker pid=4504) scorer: ..."
ACTOR_PID = re.compile(r"\((\w+) pid=(\d+)\)")


def actor_pids(log: str) -> dict[int, str]:
    """pid -> the actor class Ray names in front of its lines in a run's log (RolloutWorker, ScorerWorker, ...)."""
    return {int(pid): name for name, pid in ACTOR_PID.findall(log)}


def process_peaks(apps_csv: str, pids: dict[int, str]) -> dict[str, float]:
    """Each GPU process's peak MiB from `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,
    nounits` samples, named by its actor class where the log names the pid ("pid <n>" where it does not: the driver,
    or a process of vLLM's own). Where the pid namespace hides the processes the samples are empty: {}."""
    peaks: dict[str, float] = {}
    for line in apps_csv.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        try:
            used = float(parts[1])
        except ValueError:  # "[N/A]" where the driver cannot say
            continue
        name = pids.get(int(parts[0]), f"pid {parts[0]}")
        peaks[name] = max(peaks.get(name, 0.0), used)
    return peaks


def role_memory(memory: dict, role: str) -> dict | None:
    """summary.json "memory" of one role: its process (`scorer`), or of its replicas (`scorer0`, `scorer1`, ...) the
    largest peaks, each replica planned alike; None where no process of that role reported (the CPU, a colocated
    run)."""
    found = [m for name, m in memory.items() if m and re.fullmatch(rf"{role}\d*", name)]
    if not found:
        return None
    return {k: max(m[k] for m in found) for k in ("peak_allocated_gib", "peak_reserved_gib")}


# The actor class Ray names in a run's log for each planned role (workers/*.py)
ROLE_ACTORS = {"rollout": "RolloutWorker", "scorer": "ScorerWorker", "learner": "LearnerWorker"}


def plan_check(plan: dict, memory: dict, smi_peak_gib: float, process_mib: dict[str, float] | None = None) -> dict:
    """The run's plan (summary.json "plan": setup/fit.py FitPlan.record) against what it measured (summary.json
    "memory"), error_pct = modelled / measured - 1 throughout:
    - each actor's modelled peak against the torch peak it stands for (allocated for the learner and scorer, reserved
      for an HF rollout), and where it has one its expected reserved peak against the reserved one (reserved_*);
    - one colocated process (resources.colocate=true): the roles' expected reserved peaks together against its own;
    - the whole card against nvidia-smi's peak.
    A vLLM or SGLang rollout's engine is not in torch's numbers: it is set against nvidia-smi's peak of its actor's
    process (`process_mib`: read_cell's smi_process_peak_mib) plus those of the GPU processes the log names no actor
    for (the engine's own: SGLang's scheduler, vLLM's engine core in a subprocess), modelled as its share, what it
    holds outside torch and one CUDA context; None where the log names no process of its actor (samples hidden by
    the pid namespace), or where a process is unnamed while another planned actor's is not named either: the log of
    a cell cut short may stop before the scorer and learner print (run 4's vLLM cell), and then the unnamed
    processes are theirs, not the engine's."""

    def row(modelled: float, measured: float | None, measured_as: str) -> dict:
        error = None if not measured else 100 * (modelled / measured - 1)
        return {"modelled_gib": modelled, "measured_gib": measured, "measured_as": measured_as, "error_pct": error}

    process_mib = process_mib or {}
    engine_children = sum(mib for name, mib in process_mib.items() if name not in ROLE_ACTORS.values())
    others_named = all(
        ROLE_ACTORS.get(r) in process_mib for r, a in plan["actors"].items() if a["measured_as"] != "engine"
    )
    context = plan.get("contexts_gib", 0.0) / max(plan.get("contexts", 1), 1)
    out: dict = {}
    for role, a in plan["actors"].items():
        if a["measured_as"] == "engine":
            mib = process_mib.get(ROLE_ACTORS.get(role, ""))
            mib = mib + engine_children if mib and (others_named or not engine_children) else None
            whole = a["peak_gib"] + a.get("outside_gib", 0.0) + context
            out[role] = row(whole, mib / 1024 if mib else None, "engine")
            continue
        m = role_memory(memory, role)
        measured = m[f"peak_{a['measured_as']}_gib"] if m and a["measured_as"] in ("allocated", "reserved") else None
        out[role] = row(a["peak_gib"], measured, a["measured_as"])
        if a["measured_as"] == "allocated" and "reserved_gib" in a:
            reserved = row(a["reserved_gib"], m["peak_reserved_gib"] if m else None, "reserved")
            out[role].update({f"reserved_{k}": v for k, v in reserved.items() if k != "measured_as"})
    if memory.get("colocated"):
        together = sum(a.get("reserved_gib", a["peak_gib"]) for a in plan["actors"].values())
        out["colocated"] = row(together, memory["colocated"]["peak_reserved_gib"], "reserved")
    out["card"] = row(plan["device_peak_gib"], smi_peak_gib or None, "smi")
    return out


# <cell>_host.csv (lab/e2e_cell.sh), one line every 5 s: the time, the GPU's SM clock (MHz), its utilization (%),
# power (W) and temperature (C), the host's 1-minute load average and its CPU count
HOST_COLUMNS = ("unix_s", "sm_mhz", "gpu_util_pct", "power_w", "temp_c", "load1", "cpus")


def host_samples(csv_text: str) -> list[dict[str, float]]:
    """The samples of a <cell>_host.csv; a line the driver could not fill ("[N/A]") or cut short is skipped."""
    samples = []
    for line in csv_text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != len(HOST_COLUMNS):
            continue
        try:
            samples.append(dict(zip(HOST_COLUMNS, map(float, parts))))
        except ValueError:
            continue
    return samples


def thirds(values: list[float]) -> tuple[float, float]:
    """Medians of the first and the last third of `values` (the whole list for fewer than three)."""
    k = max(len(values) // 3, 1)
    return statistics.median(values[:k]), statistics.median(values[-k:])


# after a cell's last step: its final evaluation, summary and shutdown, and the script's 3 s before it stops sampling
STEPS_END_MARGIN_S = 20.0


def machine(samples: list[dict[str, float]], step_times: list[float]) -> dict:
    """The machine over one cell's training steps: the SM clock and host load as medians, their extremes and their
    first / last thirds, beside the step time's first / last thirds (a drift in the step that the clock or the load
    follows is the machine's); {} without samples in the steps. `step_times`: every step's time/step, warm-up
    included. The steps after the warm-up are placed at the end of the samples (their times added up, plus
    STEPS_END_MARGIN_S), so the engines' start before them and the warm-up's compiles, their load and idle clocks,
    stay out (run 3's 12-step hf_cached cell read a median GPU utilization of 0% with its compiling first step in)."""
    timed = step_times[WARMUP_STEPS:] or step_times
    if samples and timed:
        start = samples[-1]["unix_s"] - sum(timed) - STEPS_END_MARGIN_S
        samples = [s for s in samples if s["unix_s"] >= start]
    if not samples:
        return {}
    clock, load = [s["sm_mhz"] for s in samples], [s["load1"] for s in samples]
    out = {
        "samples": len(samples),
        "sm_mhz_median": statistics.median(clock),
        "sm_mhz_min": min(clock),
        "sm_mhz_thirds": thirds(clock),
        "gpu_util_pct_median": statistics.median(s["gpu_util_pct"] for s in samples),
        "power_w_median": statistics.median(s["power_w"] for s in samples),
        "temp_c_max": max(s["temp_c"] for s in samples),
        "load1_median": statistics.median(load),
        "load1_max": max(load),
        "load1_thirds": thirds(load),
        "cpus": int(samples[-1]["cpus"]),
    }
    if timed:
        out["step_s_thirds"] = thirds(timed)
    return out


def machine_table(cells: list[dict]) -> str:
    """The machine under each cell that recorded it; "" when none did."""
    sampled = [c for c in cells if c.get("machine")]
    if not sampled:
        return ""

    def pair(v: tuple[float, float] | None, digits: int) -> str:
        return "-" if v is None else f"{v[0]:.{digits}f} / {v[1]:.{digits}f}"

    lines = [
        "| cell | samples | step s: first / last third | SM clock MHz: median (min) | first / last third | GPU util %"
        " | power W | temperature max C | host load (1 min): median (max) | first / last third | CPUs |",
        "|" + "---|" * 11,
    ]
    for c in sampled:
        m = c["machine"]
        lines.append(
            f"| {cell_label(c)} | {m['samples']} | {pair(m.get('step_s_thirds'), 1)}"
            f" | {m['sm_mhz_median']:.0f} ({m['sm_mhz_min']:.0f}) | {pair(m['sm_mhz_thirds'], 0)}"
            f" | {m['gpu_util_pct_median']:.0f} | {m['power_w_median']:.0f} | {m['temp_c_max']:.0f}"
            f" | {m['load1_median']:.1f} ({m['load1_max']:.1f}) | {pair(m['load1_thirds'], 1)} | {m['cpus']} |"
        )
    return "\n".join(lines)


def run_dirs(out_dir: Path) -> Path:
    """Where lab/device_queue.sh's collect puts the run directories of the cells still running (tar's runs/)."""
    return out_dir.parent / "runs"


def started_here(out_dir: Path, cell: str) -> bool:
    """The cell's run directory has metrics and the script started the cell into out_dir (its <cell>.log, written
    from the start, is there): not some other run's folder."""
    return (run_dirs(out_dir) / cell / "metrics.jsonl").is_file() and (out_dir / f"{cell}.log").is_file()


def cell_names(out_dir: Path) -> list[str]:
    """Every cell with metrics: copied into out_dir by its script, or only in its run directory (cut short)."""
    copied = {p.name.removesuffix("_metrics.jsonl") for p in out_dir.glob("*_metrics.jsonl")}
    started = {run.name for run in run_dirs(out_dir).glob("*") if started_here(out_dir, run.name)}
    return sorted(copied | started)


def read_cell(out_dir: Path, cell: str) -> dict:
    metrics, summary = out_dir / f"{cell}_metrics.jsonl", out_dir / f"{cell}_summary.json"
    cut_short = not metrics.is_file() and started_here(out_dir, cell)
    if cut_short:
        metrics = run_dirs(out_dir) / cell / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    smi = out_dir / f"{cell}_smi.csv"
    samples = [float(x) for x in smi.read_text().split() if x.strip()] if smi.is_file() else []
    out = {"cell": cell, **summarize(rows, samples)} | ({"cut_short": True} if cut_short else {})
    apps, log = out_dir / f"{cell}_apps.csv", out_dir / f"{cell}.log"
    if apps.is_file():  # per process, so a whole-device peak above the plan can be put on the actor that made it
        out["smi_process_peak_mib"] = process_peaks(
            apps.read_text(), actor_pids(log.read_text()) if log.is_file() else {}
        )
    host = out_dir / f"{cell}_host.csv"
    if host.is_file():
        step_times = [r["time/step"] for r in training_steps(rows)]
        out["machine"] = machine(host_samples(host.read_text()), step_times)
    if cut_short:  # plan.json, written before Ray, is the plan alone: the torch peaks were in the summary never written
        plan = run_dirs(out_dir) / cell / "plan.json"
        planned = {"plan": json.loads(plan.read_text())} if plan.is_file() else {}
    else:
        planned = json.loads(summary.read_text()) if summary.is_file() else {}
    if planned.get("plan"):  # runs before session 38 did not record their plan
        out["plan_check"] = plan_check(
            planned["plan"], planned.get("memory") or {}, out["smi_peak_gib"], out.get("smi_process_peak_mib")
        )
    return out


def table(cells: list[dict]) -> str:
    cols = ["cell", "steps", "step_s", *(f"{p}_s" for p in PHASES), "smi_peak_gib", "memory_slope_gib_per_step"]
    cols += ["sampler_gap_mean", "clipped_ratio_max", "gate_passed"]

    def fmt(v) -> str:
        return f"{v:.3g}" if isinstance(v, float) else ("-" if v is None else str(v))

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join([cell_label(c), *(fmt(c.get(k)) for k in cols[1:])]) + " |" for c in cells]
    return "\n".join(lines)


def cell_label(cell: dict) -> str:
    return cell["cell"] + (" (cut short)" if cell.get("cut_short") else "")


def plan_table(cells: list[dict]) -> str:
    """Each cell's plan against its measured peaks (GiB, modelled / measured and the error), for the cells that
    recorded a plan; "" when none did."""
    checked = [c for c in cells if c.get("plan_check")]
    if not checked:
        return ""
    roles = list(dict.fromkeys(r for c in checked for r in c["plan_check"]))

    def fmt(v: dict | None) -> str:
        if v is None:
            return "-"
        if v["error_pct"] is None:
            return f"{v['modelled_gib']:.2f} / - ({v['measured_as']})"
        return f"{v['modelled_gib']:.2f} / {v['measured_gib']:.2f} ({v['error_pct']:+.1f}%)"

    lines = [
        "| cell | " + " | ".join(f"{r}: modelled / measured GiB" for r in roles) + " |",
        "|" + "---|" * (len(roles) + 1),
    ]
    lines += ["| " + " | ".join([cell_label(c), *(fmt(c["plan_check"].get(r)) for r in roles)]) + " |" for c in checked]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.bench.e2e_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="a folder of <cell>_metrics.jsonl (and <cell>_smi.csv) files")
    out_dir = parser.parse_args(argv).out_dir
    if not out_dir.is_dir():
        parser.error(
            f"{out_dir} is not a folder: give the folder the GPU script wrote its <cell>_metrics.jsonl files to"
        )
    results = [read_cell(out_dir, c) for c in cell_names(out_dir)]
    (out_dir / "e2e_report.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    planned = plan_table(results)
    if planned:
        print(
            "\nThe plan against the measured peaks (learner and scorer: torch's allocated; HF rollout: reserved; an"
            " engine's rollout: its process in nvidia-smi, with its context; card: nvidia-smi):\n"
        )
        print(planned)
    machines = machine_table(results)
    if machines:
        print("\nThe machine under each cell (nvidia-smi and /proc/loadavg every 5 s):\n")
        print(machines)


if __name__ == "__main__":
    main(sys.argv[1:])
