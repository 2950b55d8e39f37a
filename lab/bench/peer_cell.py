"""What a peer's cell script (lab/peers/*.py, run by lab.bench.peers) shares: the step timer it hands its
trainer (and the generation inside each step), the trained tokens per step it reports, the stop ids it adds to the
model's EOS, and its command line (the prompt, stop and attention options, parse, run, write the JSON).

Importing it imports nothing heavy: transformers is imported when the timer is made, inside the script's run(), after
the script's own first imports (Unsloth must patch transformers before anything else imports it).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from lab.bench.peer_prompts import DEFAULT_PROMPT_LEN
from lab.bench.peers import parse_prompt_len


def step_timer(cuda: bool) -> tuple[Any, list[float], list[float]]:
    """A transformers TrainerCallback that times every optimizer step (the device synchronized around it when
    `cuda`) and collects the mean completion length TRL logs; returns (callback, step seconds, mean lengths), the
    lists filled as the trainer runs. The callback's `ranges` gets each logged step's (min, max) completion length:
    with stop ids, whether lengths varied."""
    import time

    import torch
    from transformers import TrainerCallback

    seconds: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        generation: list[float] | None = None  # per step, once time_generation has wrapped the trainer
        pending = 0.0  # the generation seconds of the step under way

        def __init__(self):
            self.ranges: list[tuple[float, float]] = []  # per logged step, the (min, max) completion length

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
            if logs and "completions/min_length" in logs and "completions/max_length" in logs:
                self.ranges.append((float(logs["completions/min_length"]), float(logs["completions/max_length"])))

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


def add_harness_options(ap: argparse.ArgumentParser) -> None:
    """--prompt-len, --stop-ids and --flash-attention, as the harness passes them (none at its defaults)."""
    ap.add_argument(
        "--prompt-len",
        type=_argument(parse_prompt_len),
        default=DEFAULT_PROMPT_LEN,
        help="LO:HI, the reverse task's string lengths in characters (default {}:{})".format(*DEFAULT_PROMPT_LEN),
    )
    ap.add_argument(
        "--stop-ids",
        type=_argument(parse_stop_ids),
        default=(),
        help="comma-separated token ids that end a row besides the model's EOS (the harness's stop_set; default none)",
    )
    ap.add_argument(
        "--flash-attention",
        action="store_true",
        help="keep torch's SDPA off cuDNN's attention, as miniVERL's actors (ProcessSettings.cudnn_attention=False);"
        " default: torch's own choice, cuDNN first on Hopper",
    )


def apply_attention(args: argparse.Namespace) -> str:
    """--flash-attention: torch's SDPA may not pick cuDNN in this process (miniverl.process.set_attention_backends,
    the setting miniVERL's actors run with; cuDNN plans every new shape); call it in run() after the script's first
    imports. Returns the setting, as the cell's JSON records it."""
    if not args.flash_attention:
        return "torch's default (cuDNN first on Hopper)"
    from miniverl.process import set_attention_backends

    set_attention_backends(cudnn=False)
    return "flash (cuDNN's attention off, as miniVERL's actors)"


def parse_stop_ids(text: str) -> tuple[int, ...]:
    """`5,17,902`: token ids, each >= 0."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"{text[:60]!r}: write token ids as non-negative integers joined by commas, e.g. 5,17,902")
    return tuple(int(p) for p in parts)


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` for argparse's type=, its ValueError's message kept in the usage error."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return checked


def stop_on(model: Any, tokenizer: Any, stop_ids: tuple[int, ...]) -> list[int]:
    """Makes `model` (a transformers model) end a completion on `stop_ids` too: its generation_config.eos_token_id
    becomes the union miniVERL's run resolves (miniverl.models.stops: the tokenizer's EOS first, as TRL puts it, then
    the ids the model declares, then `stop_ids`). TRL 1.15 / 1.16 read that list once, in the trainer's __init__
    (`self.eos_token_ids`), for transformers' generate, the mask after a completion's first EOS and the clipped
    ratio it logs: call this before building the trainer. Returns the list."""
    from miniverl.models.stops import eos_id_list, stop_token_ids

    declared = eos_id_list(model.generation_config.eos_token_id)
    ids = list(stop_token_ids(tokenizer.eos_token_id, declared, list(stop_ids), model.config.vocab_size))
    model.generation_config.eos_token_id = ids
    return ids


def run_cell(parse_args: Callable, run: Callable[[Any], dict], argv: list[str] | None = None) -> None:
    """A cell script's main: its arguments checked, its run, the result written to --out and printed."""
    args = parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
