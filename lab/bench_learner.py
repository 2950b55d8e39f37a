"""Time LearnerWorker.update on synthetic RL-size batches (lab/bench/learner.py), one cell per line.

    python lab/bench_learner.py --cells cells.json --out results.jsonl [--profile NAME] [--shape qwen2.5-0.5b]

cells.json: a list of {"name", "objective", "rows", "prompt_tokens", "response_tokens", "topk", "settings",
"gpu_memory_gib"}; `settings` are LearnerWorker keyword arguments; "dtype" (bfloat16 on CUDA, float32 on the CPU by
default) sets the model's; "prompt_min" and "response_median" give the rows varied lengths (bench/learner.py
vary_lengths: prompts of prompt_min..prompt_tokens, responses geometric with that median, capped), "redraw": true
draws new lengths for every update (new micro-batch shapes each update, as a run's steps have: a fixed batch repeats
its shapes, which hides per-shape costs such as cuDNN attention's plans), "cudnn_attention": true lets torch's SDPA
use cuDNN (ProcessSettings.cudnn_attention; default flash attention, as the product's actors; a cell of another setting
than the cell before compiles its layers afresh: process.set_attention_backends). Three switches
measure what the product no longer does, to credit each change: "peft_lora": true gives peft's own LoRA arithmetic
back (fp32 adapter matmuls over upcast inputs), "eager_vocab": true turns off the Triton vocabulary passes
(models/vocab_kernels.py) and "per_call_rounding": true rounds the adapter to the base's dtype at every call again
instead of once per update (RoundedAdapter). Each cell builds a
fresh learner in this process (its memory cap applies to the process: run capped cells in their own process, or
last). A cell that fails (OOM, refusal) is written with its error, never dropped. --profile NAME writes the torch
profiler's top kernels for that cell's last update to <out>.NAME.prof.txt.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench import learner as bench
from miniverl.models import vocab_kernels
from miniverl.models.lora import LoraSettings
from miniverl.models.random_init import ModelShape, build_random_model, real_shape
from miniverl.process import ProcessSettings
from miniverl.workers import learner as learner_module
from miniverl.workers.learner import LearnerWorker

TINY = ModelShape(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    init_seed=0,
)
SHAPES = {"qwen2.5-0.5b": real_shape("qwen2.5-0.5b", 32768), "tiny": TINY}
_KERNELS = vocab_kernels._use_kernels
_ROUNDED = learner_module.RoundedAdapter


class PerCallRounding:
    """In place of RoundedAdapter: every adapted projection rounds its adapter in lora_delta at each call."""

    def __init__(self, model, all_used: bool = False) -> None:
        pass

    def __enter__(self) -> PerCallRounding:
        return self

    def collect(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(shape: str, device: str, target: Path) -> Path:
    if (target / "config.json").exists():
        return target
    return build_random_model(SHAPES[shape], torch.bfloat16, device, target)


def run_cell(cell: dict, model_path: Path, vocab: int, device: str, profile: Path | None) -> dict:
    if cell.get("autocast"):
        raise ValueError("the autocast candidate is gone: LoRA now computes in the base's dtype (models/lora.py)")
    vocab_kernels._use_kernels = _KERNELS if not cell.get("eager_vocab") else (lambda x: False)
    learner_module.RoundedAdapter = PerCallRounding if cell.get("per_call_rounding") else _ROUNDED
    settings = {"micro_batch_size": cell["rows"], **cell["settings"]}
    if device == "cuda" and cell.get("gpu_memory_gib") is None:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)  # an earlier capped cell's cap stays otherwise
    objective = bench.objective_for(cell["objective"], cell["topk"])
    learner = LearnerWorker(
        str(model_path),
        LoraSettings(rank=32, alpha=64.0, dropout=0.0, target_modules=ALL_LINEAR, init_seed=0),
        cell.get("dtype", "bfloat16" if device == "cuda" else "float32"),
        objective,
        lr=1e-5,
        weight_decay=0.0,
        max_grad_norm=1.0,
        process=ProcessSettings(
            device, gpu_memory_gib=cell.get("gpu_memory_gib"), cudnn_attention=cell.get("cudnn_attention", False)
        ),
        **settings,
    )
    if cell.get("peft_lora"):
        for module in learner.model.modules():
            if hasattr(module, "_peft_forward"):
                module.__class__ = type(module).__mro__[1]  # peft's own class and forward again
    full = bench.synthetic_batch(cell["rows"], cell["prompt_tokens"], cell["response_tokens"], vocab, seed=0)
    varied = cell.get("prompt_min") or cell.get("response_median")
    topk = cell["topk"] if cell["objective"] == "gkd" else None

    def draw(seed: int):  # the rows' lengths as `seed` draws them (every row full without prompt_min and a median)
        prompt_min = cell.get("prompt_min") or cell["prompt_tokens"]
        batch = bench.vary_lengths(full, prompt_min, cell.get("response_median", 0), seed)
        return batch, bench.synthetic_scores(batch, vocab, topk, seed=0)

    if cell.get("redraw") and not varied:
        raise ValueError("redraw draws new row lengths each update: give the cell prompt_min or response_median")
    batch, scores = draw(0)
    warmup, repeats = cell.get("warmup", 1), cell.get("repeats", 3)
    # redraw: every update new lengths, so new micro-batch shapes, as every step of a run has
    result = bench.time_updates(learner, batch, scores, warmup, repeats, draw if cell.get("redraw") else None)
    if profile is not None:
        bench.profile_update(learner, batch, scores, profile)
    del learner
    gc.collect()  # nothing of this cell's learner may stay allocated into the next cell's peak
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--model-dir", default=Path("/tmp/bench_learner_model"), type=Path)
    parser.add_argument("--profile", default=None, help="name of the cell to profile")
    parser.add_argument("--only", default=None, help="comma-separated names of the cells to run")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cells = json.loads(args.cells.read_text())
    if args.only:
        wanted = set(args.only.split(","))
        cells = [c for c in cells if c["name"] in wanted]
    model_path = build_model(args.shape, device, args.model_dir / args.shape)
    vocab = SHAPES[args.shape].vocab_size
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    for cell in cells:
        started = time.time()
        prof = args.out.with_suffix(f".{cell['name']}.prof.txt") if args.profile == cell["name"] else None
        try:
            record = {**cell, **meta, "ok": True, **run_cell(cell, model_path, vocab, device, prof)}
        except Exception as e:  # an OOM or a refusal is a result of the cell, reported with its reason
            record = {**cell, **meta, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
            if device == "cuda":
                torch.cuda.empty_cache()
        record["wall_s"] = time.time() - started
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        brief = {k: record.get(k) for k in ("name", "ok", "tokens_per_s", "median_update_s", "peak_allocated_gib")}
        print(json.dumps(brief), flush=True)


if __name__ == "__main__":
    main()
