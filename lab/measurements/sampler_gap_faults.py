"""The per-step sampler-gap proof, measured on the CPU with the built-in reverse models (the shipped ones).

For each rollout backend and dtype: the conformance gate calibrates the per-step bound (objectives/ratios.py,
step_bound), then
- honest: --honest-steps steps of an honest replica, each one refresh; every step whose gap crosses the bound is a
  false alarm (counted, and the run goes on);
- fault: a replica that samples with the adapter of its first generate call (the gate's, v0) while its buffers,
  digest and probe are current (tests/step/faults.py, StaleSamplingWorker), at each --lrs learning rate: the step
  at which it is stopped (none within --fault-steps: missed), its gap and the version test's z at every step.
The honest cells record the version test's largest z per step (objectives/sampler_check.py VERSION_TESTS; refused
above 6) over the steps it voted on, and on how many steps each comparison was armed (an honest z below -6: the
mirror image of a stale sampler's, which would have been refused). --twins runs each fault cell's honest twin (same
learning rate, prompts and seeds, --fault-steps steps): its per-step z beside the stale run's shows whether the
stale sampler was caught where the honest run said the test could see it.
Writes one JSON (--out) and prints a line per cell. In-process (no Ray): the learner, rollout and scorer are the
actors' classes called directly, as tests/step/test_sync.py does.

    PYTHONPATH=. python lab/measurements/sampler_gap_faults.py --out lab/results/sampler-gap/cpu-bf16.json \
        --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from miniverl.batches import PromptBatch  # noqa: E402
from miniverl.data.tasks import reverse_task  # noqa: E402
from miniverl.models.builtin import SHIPPED_DIR, torch_threads  # noqa: E402
from miniverl.models.lora import LoraSettings  # noqa: E402
from miniverl.objectives.gkd import GkdObjective  # noqa: E402
from miniverl.objectives.sampler_check import SamplerGapError  # noqa: E402
from miniverl.process import ProcessSettings  # noqa: E402
from miniverl.rewards import ExactMatchReward  # noqa: E402
from miniverl.rollout.sampling import SamplingParams  # noqa: E402
from miniverl.seeds import sampling_seed  # noqa: E402
from miniverl.step.conformance import conformance_gate  # noqa: E402
from miniverl.step.controller import StrictSyncController  # noqa: E402
from miniverl.workers.learner import LearnerWorker  # noqa: E402
from miniverl.workers.rollout import RolloutWorker  # noqa: E402
from miniverl.workers.scorer import ScorerWorker  # noqa: E402
from tests.step.faults import StaleSamplingWorker  # noqa: E402

LORA = LoraSettings(
    rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), init_seed=0
)
CPU = ProcessSettings("cpu", torch_threads=1)
PROMPTS_PER_STEP = 8
GATE_PROMPTS = 16


def models() -> tuple[Path, Path]:
    """The shipped reverse recipe's student and teacher."""
    found = sorted(SHIPPED_DIR.glob("reverse-*"))
    if not found:
        raise SystemExit(
            f"no shipped reverse models under {SHIPPED_DIR}: run scripts/build_models.py --experiments --ship"
        )
    return found[0] / "student", found[0] / "teacher"


def prompt_batch(tok, rng: random.Random, count: int, step: int) -> PromptBatch:
    examples = [reverse_task(rng, 3, 8) for _ in range(count)]
    ids = [tok(e.prompt)["input_ids"] for e in examples]
    return PromptBatch(ids, [f"s{step}-{i}" for i in range(count)], [e.answer for e in examples])


def build(worker_cls, backend: str, dtype: str, lr: float):
    from transformers import AutoTokenizer

    student, teacher = models()
    tok = AutoTokenizer.from_pretrained(str(student))
    learner = LearnerWorker(str(student), LORA, dtype, GkdObjective(0.5, 1.0, 0), lr, 0.0, 1.0, 8, CPU)
    rollout = worker_cls(backend, str(student), LORA, dtype, CPU)
    scorer = ScorerWorker(str(teacher), dtype, 8, CPU)
    ctl = StrictSyncController(rollout, scorer, learner, ExactMatchReward(tok), 0, 1.0)
    return ctl, tok


def gate(ctl, tok, params: SamplingParams, backend: str) -> dict:
    prompts = prompt_batch(tok, random.Random(99), GATE_PROMPTS, -1)
    return conformance_gate(ctl, prompts, params, GkdObjective(0.5, 1.0, 0), ("gkd", backend), lambda *_: None)


def train_step(ctl, tok, rng: random.Random, step: int, params: SamplingParams) -> dict:
    """One step on fresh prompts, sampled with the run's seed of training step `step`."""
    batch = prompt_batch(tok, rng, PROMPTS_PER_STEP, step)
    return ctl.step(batch, dataclasses.replace(params, seed=sampling_seed(0, "train", step)))


def honest(backend: str, dtype: str, lr: float, steps: int, params: SamplingParams) -> dict:
    ctl, tok = build(RolloutWorker, backend, dtype, lr)
    record = {"backend": backend, "dtype": dtype, "lr": lr, "gate": gate(ctl, tok, params, backend)}
    rng, rows, alarms, zs, per_step = random.Random(7), [], [], [], []
    armed = {"previous": 0, "base": 0}
    started = time.perf_counter()
    for step in range(steps):
        try:
            m = train_step(ctl, tok, rng, step, params)
        except SamplerGapError as e:
            alarms.append({"step": step, "error": str(e)})
            continue
        rows.append((m["sampler_gap_mean"], m["sampler_gap_p99"], m["sampler_gap_tail_frac"]))
        per_step.append((round(m["sampler_vs_previous_z"], 2), round(m["sampler_vs_base_z"], 2)))
        if m["sampler_version_tokens"]:  # a step the version test voted on (not v0's): its larger z
            zs.append(max(m["sampler_vs_previous_z"], m["sampler_vs_base_z"]))
            for name in armed:
                armed[name] += int(m[f"sampler_vs_{name}_armed"])
    means, p99s, tails = (sorted(x) for x in zip(*rows))
    zs.sort()
    record.update(
        steps=steps,
        refreshes=ctl.sync.refreshes,
        false_alarms=len(alarms),
        alarms=alarms[:5],
        step_mean={"median": statistics.median(means), "max": means[-1]},
        step_p99={"median": statistics.median(p99s), "max": p99s[-1]},
        step_tail_frac={"median": statistics.median(tails), "max": tails[-1]},
        version_z={"median": statistics.median(zs), "max": zs[-1], "voted_steps": len(zs)} if zs else None,
        armed_steps=armed,
        version_z_steps=per_step,
        seconds=round(time.perf_counter() - started, 1),
    )
    return record


def fault(backend: str, dtype: str, lr: float, steps: int, params: SamplingParams) -> dict:
    ctl, tok = build(StaleSamplingWorker, backend, dtype, lr)
    record = {"backend": backend, "dtype": dtype, "lr": lr, "gate": gate(ctl, tok, params, backend)}
    rng, gaps, zs, caught = random.Random(7), [], [], None
    for step in range(steps):
        try:
            m = train_step(ctl, tok, rng, step, params)
        except SamplerGapError as e:
            caught = {"step": step, "stale_versions": ctl.learners[0].version, "error": str(e)}
            break
        gaps.append(round(m["sampler_gap_mean"], 6))
        zs.append((round(m["sampler_vs_previous_z"], 2), round(m["sampler_vs_base_z"], 2)))
    record.update(caught=caught, gap_means=gaps, version_z=zs)
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backends", nargs="+", default=["hf_reference", "hf_cached"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--honest-steps", type=int, default=1000)
    ap.add_argument("--honest-lr", type=float, default=2e-3, help="the default run's trainer.lr")
    ap.add_argument("--fault-steps", type=int, default=20)
    ap.add_argument("--lrs", nargs="+", type=float, default=[2e-3, 2e-4, 2e-5])
    ap.add_argument("--twins", action="store_true", help="after each fault cell, its honest twin (--fault-steps)")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # a line per cell as it ends
    params = SamplingParams(n=4, max_new_tokens=16, stop_token_ids=(2,))
    out = {"command": " ".join(sys.argv), "honest": [], "fault": [], "twins": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with torch_threads(1):
        for backend in args.backends:
            for dtype in args.dtypes:
                for lr in args.lrs:
                    r = fault(backend, dtype, lr, args.fault_steps, params)
                    out["fault"].append(r)
                    at = r["caught"]["step"] if r["caught"] else f"missed in {args.fault_steps}"
                    print(
                        f"fault {backend} {dtype} lr {lr:g}: caught at step {at}; gaps {r['gap_means'][:6]};"
                        f" version z {r['version_z'][:6]}; {r['caught']['error'][:90] if r['caught'] else ''}",
                        flush=True,
                    )
                    args.out.write_text(json.dumps(out, indent=1))
                    if args.twins:
                        t = honest(backend, dtype, lr, args.fault_steps, params)
                        out["twins"].append(t)
                        print(
                            f"twin {backend} {dtype} lr {lr:g}: armed steps {t['armed_steps']} of"
                            f" {t['version_z']['voted_steps'] if t['version_z'] else 0} voted; version z"
                            f" {t['version_z_steps'][:6]}",
                            flush=True,
                        )
                        args.out.write_text(json.dumps(out, indent=1))
                if args.honest_steps:
                    r = honest(backend, dtype, args.honest_lr, args.honest_steps, params)
                    out["honest"].append(r)
                    print(
                        f"honest {backend} {dtype}: {r['false_alarms']} false alarms in {r['steps']} steps; gate mean"
                        f" {r['gate']['mean_gap']:.2e} p99 {r['gate']['p99_gap']:.2e}; bound {r['gate']['step_bound']};"
                        f" step mean {r['step_mean']} tail {r['step_tail_frac']} version z {r['version_z']}"
                        f" ({r['seconds']} s)",
                        flush=True,
                    )
                    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
