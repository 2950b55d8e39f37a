"""What a peer's cell script (scripts/peers/*.py, run by miniverl.bench.peers) shares: the step timer it hands its
trainer, the trained tokens per step it reports, and its command line (parse, run, write the JSON).

Importing it imports nothing heavy: transformers is imported when the timer is made, inside the script's run(), after
the script's own first imports (Unsloth must patch transformers before anything else imports it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def step_timer(cuda: bool) -> tuple[Any, list[float], list[float]]:
    """A transformers TrainerCallback that times every optimizer step (the device synchronized around it when
    `cuda`) and collects the mean completion length TRL logs; returns (callback, step seconds, mean lengths), the
    lists filled as the trainer runs."""
    import time

    import torch
    from transformers import TrainerCallback

    seconds: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_args, **_kwargs):
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **_kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    return Timer(), seconds, lengths


def trained_tokens_per_step(rows: int, mean_lengths: list[float], max_new_tokens: int) -> float:
    """rows x the median of the mean completion lengths TRL logged after the first step (EOS included); rows x
    `max_new_tokens` if it logged none. (Peers run 3 took the upper median of an even count: 0.3% high for TRL.)"""
    import statistics

    timed = mean_lengths[1:] or mean_lengths
    return rows * (statistics.median(timed) if timed else max_new_tokens)


def run_cell(parse_args: Callable, run: Callable[[Any], dict], argv: list[str] | None = None) -> None:
    """A cell script's main: its arguments checked, its run, the result written to --out and printed."""
    args = parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
