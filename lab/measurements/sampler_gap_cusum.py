"""The sequential sampler tests (objectives/sequential_check.py) against the per-step ones alone, on the CPU with the
built-in reverse models, at small batches (issue 76: --prompts 4 x n 2 = 8 rows).

- fault: the stale generation path of tests/step/faults.py (StaleSamplingWorker: samples with the gate's v0 adapter
  while its buffers, digest and probe are current) at each --lrs, twice: with the CUSUM, and with it switched off (its
  threshold infinite: the per-step bound and the version test alone); the step each is stopped at and which test
  stopped it, with every step's mean gap, per-step bound, z and CUSUM statistic;
- honest: --honest-steps steps of an honest replica at --honest-lr; alarms of either test, the largest z and CUSUM.
In-process (no Ray), as lab/measurements/sampler_gap_faults.py, whose builders it reuses.

    PYTHONPATH=. python lab/measurements/sampler_gap_cusum.py --out lab/results/sampler-gap/cusum-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import miniverl.objectives.sequential_check as sequential_check  # noqa: E402
from lab.measurements.sampler_gap_faults import build, gate, prompt_batch  # noqa: E402
from miniverl.models.builtin import torch_threads  # noqa: E402
from miniverl.objectives.sampler_check import SamplerGapError  # noqa: E402
from miniverl.rollout.sampling import SamplingParams  # noqa: E402
from miniverl.seeds import sampling_seed  # noqa: E402
from miniverl.workers.rollout import RolloutWorker  # noqa: E402
from tests.step.faults import StaleSamplingWorker  # noqa: E402

THRESHOLD = sequential_check.CUSUM_THRESHOLD


def step_record(ctl, m: dict) -> dict:
    learner = ctl.learners[0]
    tokens = int(m["response_tokens"])
    return {
        "gap": round(m["sampler_gap_mean"], 6),
        "bound": round(learner.sampler_gap.bound.mean_at(tokens), 6),
        "tokens": tokens,
        "z": round(m["sampler_gap_z"], 3),
        "cusum": round(m["sampler_gap_cusum"], 3),
        "version_tokens": m["sampler_version_tokens"],
        "vz": (round(m["sampler_vs_previous_z"], 2), round(m["sampler_vs_base_z"], 2)),
        "vcusum": (round(m["sampler_vs_previous_cusum"], 2), round(m["sampler_vs_base_cusum"], 2)),
    }


def run(worker_cls, backend, dtype, lr, steps, prompts, params, cusum: bool, stop_on_alarm: bool) -> dict:
    sequential_check.CUSUM_THRESHOLD = THRESHOLD if cusum else math.inf  # the module's value, or off
    ctl, tok = build(worker_cls, backend, dtype, lr)
    record = {"backend": backend, "dtype": dtype, "lr": lr, "cusum": cusum, "gate": gate(ctl, tok, params, backend)}
    rng, per_step, alarms = random.Random(7), [], []
    started = time.perf_counter()
    for step in range(steps):
        batch = prompt_batch(tok, rng, prompts, step)
        try:
            m = ctl.step(batch, dataclasses.replace(params, seed=sampling_seed(0, "train", step)))
        except SamplerGapError as e:
            text = str(e)
            sequential = "CUSUM" in text
            kind = "version" if "stamped with" in text else "gap"
            which = f"{'sequential' if sequential else 'per-step'} {kind}"
            alarms.append({"step": step, "test": which, "error": str(e)[:400]})
            if stop_on_alarm:
                break
            continue
        per_step.append(step_record(ctl, m))
    record.update(steps=per_step, alarms=alarms, seconds=round(time.perf_counter() - started, 1))
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backends", nargs="+", default=["hf_cached", "hf_reference"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--lrs", nargs="*", type=float, default=[2e-4, 2e-5])
    ap.add_argument("--fault-steps", type=int, default=12)
    ap.add_argument("--honest-steps", type=int, default=1000)
    ap.add_argument("--honest-lr", type=float, default=2e-4)
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    params = SamplingParams(n=args.n, max_new_tokens=16, stop_token_ids=(2,))
    out = {"command": " ".join(sys.argv), "rows": args.prompts * args.n, "fault": [], "honest": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with torch_threads(1):
        for backend in args.backends:
            for dtype in args.dtypes:
                for lr in args.lrs:
                    for cusum in (True, False):
                        r = run(
                            StaleSamplingWorker, backend, dtype, lr, args.fault_steps, args.prompts, params, cusum, True
                        )
                        out["fault"].append(r)
                        at = f"step {r['alarms'][0]['step']} by {r['alarms'][0]['test']}" if r["alarms"] else "missed"
                        gaps = [(s["gap"], s["bound"], s["z"], s["cusum"], s["vz"], s["vcusum"]) for s in r["steps"]]
                        print(
                            f"fault {backend} {dtype} lr {lr:g} cusum {cusum}: {at}; (gap, bound, z, S, vz, vS) {gaps}"
                        )
                        args.out.write_text(json.dumps(out, indent=1))
                if args.honest_steps:
                    r = run(
                        RolloutWorker,
                        backend,
                        dtype,
                        args.honest_lr,
                        args.honest_steps,
                        args.prompts,
                        params,
                        True,
                        False,
                    )
                    zs = [s["z"] for s in r["steps"]]
                    r["summary"] = {
                        "steps": len(r["steps"]) + len(r["alarms"]),
                        "alarms": len(r["alarms"]),
                        "z_max": max(zs),
                        "z_median": sorted(zs)[len(zs) // 2],
                        "cusum_max": max(s["cusum"] for s in r["steps"]),
                        "vote_z_max": [max(s["vz"][i] for s in r["steps"]) for i in (0, 1)],
                        "vote_cusum_max": [max(s["vcusum"][i] for s in r["steps"]) for i in (0, 1)],
                    }
                    out["honest"].append(r)
                    print(f"honest {backend} {dtype}: {r['summary']} ({r['seconds']} s)")
                    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
