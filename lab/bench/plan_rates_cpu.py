"""The CPU rates of setup/estimate.py's throughput model: hf_cached generation, the teacher's forward and the student's
forward and backward on the built-in reverse models, one torch thread (each actor's share on 2 cores), at batch sizes
where per-call overheads no longer count. `PYTHONPATH=$PWD python3 -m lab.bench.plan_rates_cpu` (models cached)."""

from __future__ import annotations

import random
import time

import torch

PROMPT_TOKENS, NEW_TOKENS = 12, 16  # the reverse task's prompts (up to 8 letters and the template) and max_new_tokens
ROWS = (64, 512, 4096, 16384)
MICRO_ROWS = 512


def main() -> None:
    from transformers import AutoModelForCausalLM

    from miniverl.models.builtin import BuiltinRecipe, builtin_dir
    from miniverl.models.lora import LoraSettings
    from miniverl.rollout.hf_cached import HFCachedBackend
    from miniverl.rollout.sampling import SamplingParams
    from tests.test_config import load

    torch.set_num_threads(1)
    cfg = load()
    root = builtin_dir(cfg.model.cache_dir, BuiltinRecipe("reverse", cfg.data.min_len, cfg.data.max_len))
    backend = HFCachedBackend(str(root / "student"), LoraSettings.from_config(cfg.model.lora), torch.float32, "cpu")
    teacher = AutoModelForCausalLM.from_pretrained(str(root / "teacher")).eval()
    student = AutoModelForCausalLM.from_pretrained(str(root / "student"))
    rng = random.Random(0)
    for rows in ROWS:
        prompts = [[rng.randrange(4, 40) for _ in range(PROMPT_TOKENS)] for _ in range(rows)]
        started = time.perf_counter()
        backend.generate(prompts, SamplingParams(1, NEW_TOKENS, 1.0, seed=1), list(range(rows)))
        generate = time.perf_counter() - started
        x = torch.randint(4, 40, (rows, PROMPT_TOKENS + NEW_TOKENS))
        started = time.perf_counter()
        with torch.no_grad():
            for i in range(0, rows, MICRO_ROWS):
                teacher(x[i : i + MICRO_ROWS]).logits.log_softmax(-1)
        score = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(0, rows, MICRO_ROWS):
            student(x[i : i + MICRO_ROWS]).logits.log_softmax(-1).mean().backward()
        update = time.perf_counter() - started
        tokens = rows * NEW_TOKENS
        print(
            f"{rows:>6} rows: generate {tokens / generate:,.0f}, score {tokens / score:,.0f},"
            f" update {tokens / update:,.0f} response tokens/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
