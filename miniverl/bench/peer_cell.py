"""What a peer's cell script (scripts/peers/*.py, run by miniverl.bench.peers) shares: the step timer it hands its
trainer (and the generation inside each step), the trained tokens per step it reports, and its command line (parse,
run, write the JSON).

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
        generation: list[float] | None = None  # per step, once time_generation has wrapped the trainer
        pending = 0.0  # the generation seconds of the step under way

        def on_step_begin(self, *_args, **_kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_args, **_kwargs):
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - self.t0)
            if self.generation is not None:
                self.generation.append(self.pending)
                self.pending = 0.0

        def on_log(self, _args, _state, _control, logs=None, **_kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    return Timer(), seconds, lengths


# TRL 1.15 / 1.16 (DistillationTrainer, and GRPOTrainer as Unsloth patches it): the weights synced to vLLM when the
# step changed, then the completions drawn (vLLM or transformers' generate), once per optimizer step
GENERATE_METHOD = "_generate_single_turn"


def time_generation(trainer: Any, timer: Any, cuda: bool) -> list[float] | None:
    """Wraps the trainer's generation (GENERATE_METHOD) so that `timer` (step_timer's callback) also records, per
    optimizer step, the seconds spent in it (the device synchronized around it when `cuda`). Returns that list,
    filled as the trainer runs; None when the trainer has no such method (a TRL that renamed it: not timed)."""
    import time

    import torch

    method = getattr(trainer, GENERATE_METHOD, None)
    if method is None:
        return None

    def timed(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
            timer.pending += time.perf_counter() - t0

    setattr(trainer, GENERATE_METHOD, timed)
    timer.generation = []
    return timer.generation


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
