"""Measure how far each HF rollout backend's probe log-probs sit from the learner's on the same weights.

    python lab/measurements/measure_probe_gaps.py [--out lab/results/probe-tolerance-cpu.json]

For the built-in student, a tiny trained model and a random-init model, with several random LoRA adapters,
the learner (peft forward) and each backend (hf_reference: the peft model; hf_cached: its merged serving
weights) compute the strict-sync probe; the max |gap| per case is what FP32_PROBE_TOLERANCE in
miniverl/served_policy.py must sit above. Also: how far one random adapter moves the probe (what it must
sit below).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

ADAPTER_SEEDS = (1, 2, 3)
ADAPTER_STD = 0.05  # a non-zero adapter (lora_B starts at 0, which would compare the base model only)
# bf16 on the CPU only checks the half-precision path runs and sits far below HALF_PROBE_TOLERANCE; the
# constant itself comes from GPU measurements (DESIGN.md), where kernels differ between engines.
DTYPES = (torch.float32, torch.bfloat16)
TINY_ARCH = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
)


def models(tmp: Path) -> dict[str, str]:
    from miniverl.config import MiniVerlConfig
    from miniverl.models.builtin import ArchSpec, BuiltinRecipe, SftSpec, build_model, ensure_builtin_models

    cfg = MiniVerlConfig()
    recipe = BuiltinRecipe(cfg.data.task, cfg.data.min_len, cfg.data.max_len)
    out = {"builtin-student": str(ensure_builtin_models(cfg.model.cache_dir, recipe)["student"])}
    tiny = BuiltinRecipe(task="reverse", min_len=2, max_len=4)
    for name, steps in (("tiny-trained", 120), ("tiny-random", 0)):
        build_model(tmp / name, tiny, ArchSpec(**TINY_ARCH), SftSpec(steps, 32, 1e-2, 3), lambda *_: None)
        out[name] = str(tmp / name)
    return out


def main() -> None:
    from miniverl.config import MiniVerlConfig
    from miniverl.models.logprobs import sequence_logprobs
    from miniverl.models.lora import LoraSettings, adapter_state, build_lora_model, load_adapter_state
    from miniverl.rollout.hf_cached import HFCachedBackend
    from miniverl.rollout.hf_reference import HFReferenceBackend
    from miniverl.served_policy import draw_probe, max_gap

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lora = LoraSettings.from_config(MiniVerlConfig().model.lora)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for (model_name, path), dtype in itertools.product(models(Path(tmp)).items(), DTYPES):
            learner = build_lora_model(path, lora, dtype, "cpu").eval()
            cfg = learner.get_base_model().config
            probe = draw_probe(cfg.vocab_size, cfg.max_position_embeddings)
            backends = {
                "hf_reference": HFReferenceBackend(path, lora, dtype, "cpu"),
                "hf_cached": HFCachedBackend(path, lora, dtype, "cpu"),
            }
            base = sequence_logprobs(learner, probe)
            for seed in ADAPTER_SEEDS:
                g = torch.Generator().manual_seed(seed)
                adapter = {
                    k: (torch.randn(v.shape, generator=g) * ADAPTER_STD).to(v.dtype)
                    for k, v in adapter_state(learner).items()
                }
                load_adapter_state(learner, adapter)
                want = sequence_logprobs(learner, probe)
                for name, backend in backends.items():
                    backend.load_adapter(adapter)
                    t0 = time.perf_counter()
                    got = backend.probe_logprobs(probe)
                    rows.append(
                        {
                            "model": model_name,
                            "backend": name,
                            "dtype": str(dtype).removeprefix("torch."),
                            "adapter_seed": seed,
                            "probe_tokens": sum(map(len, got)),
                            "max_gap_to_learner": max_gap(got, want),
                            "adapter_moves_probe_by": max_gap(want, base),
                            "probe_seconds": time.perf_counter() - t0,
                        }
                    )
                    print(json.dumps(rows[-1]))
    worst = {
        str(d).removeprefix("torch."): max(r["max_gap_to_learner"] for r in rows if r["dtype"] in str(d))
        for d in DTYPES
    }
    print(f"worst gap per dtype (nats): {worst}")
    if args.out:
        meta = {"machine": platform.platform(), "cpu": platform.processor(), "torch": torch.__version__}
        Path(args.out).write_text(json.dumps({"meta": meta, "worst_gap": worst, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
