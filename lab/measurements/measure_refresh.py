"""Time the strict-sync refresh alone, on Ray actors built exactly as a run builds them.

    PYTHONPATH=<tree> python lab/measurements/measure_refresh.py [--repeats 32] [overrides ...]

Only a refresh (`controller.ensure_served()` after marking the served policy out of date: publish, hand
over, load, verify) is timed, repeated on the default experiment's actors, so a tree before and after a
refresh change can be compared on a busy machine in short alternating runs (the whole step's time moves
with every other load on the machine). Prints one JSON line: the median and mean, the median of the refreshes
proven by the served digest alone and of those that also ran the probe (trainer.probe_every: 1 probes every
refresh), each stage's median (`time/refresh/<stage>`) by proof, and whether the adapter went on the device
(resources.weight_sync). Without an update in between, the probe holds only the fixed sequences (a run adds a few
on-policy rows to it: --extra-rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CONF = Path(__file__).resolve().parents[2] / "conf"


def main() -> None:
    import ray
    import torch
    from hydra import compose, initialize_config_dir

    from miniverl.cluster.launch import build_actors, start_ray
    from miniverl.config import register_configs, to_config
    from miniverl.objectives import build_objective
    from miniverl.rewards import ExactMatchReward
    from miniverl.setup.prepare import prepare
    from miniverl.step.controller import StrictSyncController

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=32)
    ap.add_argument(
        "--extra-rows", type=int, default=0, help="random rows added to every probe, as a run adds on-policy rows"
    )
    ap.add_argument("--extra-tokens", type=int, default=640, help="tokens of each extra row")
    ap.add_argument("--parts", action="store_true", help="also time each refresh call alone and a no-op round trip")
    ap.add_argument("overrides", nargs="*", default=["+experiment=gkd", "tracking=disabled"])
    args = ap.parse_args()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = to_config(compose(config_name="config", overrides=args.overrides))
    setup = prepare(cfg, log=lambda *_: None)
    objective = build_objective(cfg.objective)
    start_ray(cfg, log=lambda *_: None)
    try:
        actors, _ = build_actors(cfg, setup, objective)
        reward = ExactMatchReward(setup.tokenizer)
        ctl = StrictSyncController(
            actors["rollout"],
            actors["scorer"],
            actors["learner"],
            reward,
            objective.teacher_support_k,
            1.0,
            weight_sync=cfg.resources.weight_sync,
            probe_every=cfg.trainer.probe_every,
        )
        g = torch.Generator().manual_seed(0)
        vocab = len(setup.tokenizer)
        extra = [
            tuple(torch.randint(0, vocab, (args.extra_tokens,), generator=g).tolist()) for _ in range(args.extra_rows)
        ]
        ctl.ensure_served()  # first refresh: reads the probe and tolerances, measures the replica's noise
        times, proofs, stages = [], [], {}
        for _ in range(args.repeats):
            ctl.sync.learner_updated()  # republish the same version: a refresh without an update
            ctl.sync._recent = list(extra)
            t0 = time.perf_counter()
            ctl.ensure_served()
            times.append(time.perf_counter() - t0)
            proofs.append("probe" if ctl.last_probe["probe_ran"] else "digest")
            for k, v in ctl.last_probe.items():
                if k.startswith("time/refresh/"):
                    stages.setdefault(proofs[-1], {}).setdefault(k.removeprefix("time/refresh/"), []).append(v)
        probe = [list(s) for s in ctl.sync.fixed] + [list(s) for s in extra]
        parts = time_parts(ctl, actors, args.repeats, probe) if args.parts else {}
    finally:
        ray.shutdown()
    result = {
        "weight_sync": cfg.resources.weight_sync,
        "on_device": ctl.sync.on_device,
        "probe_every": cfg.trainer.probe_every,
        "median_ms": round(statistics.median(times) * 1e3, 2),
        "mean_ms": round(statistics.mean(times) * 1e3, 2),
        "median_ms_by_proof": {
            p: round(statistics.median(t for t, q in zip(times, proofs) if q == p) * 1e3, 2)
            for p in sorted(set(proofs))
        },
        "refreshes_by_proof": {p: proofs.count(p) for p in sorted(set(proofs))},
        "stage_median_ms": {
            p: {k: round(statistics.median(v) * 1e3, 2) for k, v in by_stage.items()} for p, by_stage in stages.items()
        },
        "times_ms": [round(t * 1e3, 2) for t in times],
        "probe_tokens": sum(map(len, probe)),
        "parts_median_ms": parts,
    }
    print(json.dumps(result))


def time_parts(ctl, actors, repeats: int, probe: list[list[int]]) -> dict[str, float]:
    """Each refresh call alone, from the driver (its Ray round trip included), median ms; `noop` is a call that
    does nothing (device_uuid): the round-trip floor every stage pays. `serve` is a replica's load and served
    digest, `serve_probe` the same with the probe."""
    import ray

    learner, rollout = actors["learner"][0], actors["rollout"][0]
    snapshot = learner.publish_policy.remote(True, ctl.sync.on_device)
    calls = {
        "noop": lambda: learner.device_uuid.remote(),
        "learner_probe": lambda: learner.probe_logprobs.remote(probe),
        "publish": lambda: learner.publish_policy.remote(True, ctl.sync.on_device),
        "serve": lambda: rollout.serve.remote(snapshot),
        "serve_probe": lambda: rollout.serve.remote(snapshot, probe),
    }
    out = {}
    for name, call in calls.items():
        ray.get(call())  # warm
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ray.get(call())
            ts.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(ts) * 1e3, 2)
    return out


if __name__ == "__main__":
    main()
