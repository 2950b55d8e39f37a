"""Time each strict-sync refresh call in one process (no Ray, so no round trips) at a real student shape.

    PYTHONPATH=. python lab/measurements/time_refresh_calls.py /tmp/m/student [--device cuda] [--repeats 10]

Learner and hf_cached replica of the 4080 recipe's student (LoRA r32 on every linear layer, bf16) built in this
process; prints one JSON line with the median ms of: publish (the learner's digest; on a GPU through its flat
buffer as with resources.weight_sync=auto, on the CPU with the CPU copies), serve (the replica's load and served
digest: the whole proof of a refresh between probes), served_digest alone, and the two probes (the learner's and
the replica's, on the fixed 4 x 64-token probe): what a probed refresh adds. Make the model with
scripts/make_random_model.py --shape qwen2.5-0.5b.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    import torch

    from miniverl.models.lora import LoraSettings
    from miniverl.objectives.gkd import GkdObjective
    from miniverl.process import ProcessSettings
    from miniverl.workers.learner import LearnerWorker
    from miniverl.workers.rollout import RolloutWorker

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rank", type=int, default=32)
    args = ap.parse_args()
    lora = LoraSettings(args.rank, 2.0 * args.rank, 0.0, LORA_TARGETS, 0)
    process = ProcessSettings(args.device, torch_threads=1 if args.device == "cpu" else 0)
    learner = LearnerWorker(args.model, lora, "bfloat16", GkdObjective(0.5, 1.0, 0), 1e-4, 0.0, 1.0, 2, process)
    rollout = RolloutWorker("hf_cached", args.model, lora, "bfloat16", process)
    probe = learner.probe_sequences()
    on_device = args.device == "cuda"

    def median_ms(fn, repeats: int) -> float:
        fn()  # warm: allocations, the first IPC mapping, lazy kernels
        times = []
        for _ in range(repeats):
            if on_device:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if on_device:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e3, 2)

    snapshot = learner.publish_policy(True, on_device)
    served = rollout.serve(snapshot)
    if served.digest != snapshot.identity.digest:
        raise SystemExit(f"the served digest {served.digest} is not the published {snapshot.identity.digest}")
    probes = max(1, args.repeats // 3)  # a probe costs seconds on the CPU
    result = {
        "device": args.device,
        "adapter_params": sum(t.numel() for t in learner._outbox.tensors.values()),
        "probe_tokens": sum(map(len, probe)),
        "publish": median_ms(lambda: learner.publish_policy(True, on_device), args.repeats),
        "serve": median_ms(lambda: rollout.serve(snapshot), args.repeats),
        "served_digest": median_ms(rollout.backend.served_digest, args.repeats),
        "learner_probe": median_ms(lambda: learner.probe_logprobs(probe), probes),
        "served_probe": median_ms(lambda: rollout.probe_logprobs(probe), probes),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
