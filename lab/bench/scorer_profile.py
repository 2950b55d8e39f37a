"""The teacher's scoring of one step by itself: its seconds, scored tokens/s, and where they go (issue 32).

Decode-profile run 8: one behind with separate actors, a gkd_4080 step is the GPU's work in series (generate ~1.16 s,
score ~1.47 s, a compiled update ~2.4 s), and the scorer's 1.47 s for 131k response tokens (a bf16 1.5B teacher,
top-64 + tail, forwards of 8,080 tokens) is the largest piece never profiled. This times `ScorerWorker.score` on a
synthetic step (bench/learner.py synthetic_batch: full-length rows, as the recipe's random models produce) and runs
it once more under the torch profiler, split by the phases score() labels:

- scorer/forward: the teacher's decoder over the packed rows (prompt and response tokens);
- scorer/head: the LM head on a chunk of response positions, its log-sum-exp and the sampled tokens' log-probs;
- scorer/support: the top-K log-probs, their ids and the tail (or the whole log-softmax);
- scorer/handover: the scores to the CPU, as the actor returns them;

plus the top kernels by time. On a GPU `--share-gib` caps the process as the recipe's scorer actor is capped
(gkd_4080: 0.35 of a 16 GiB card less its CUDA context = 4.94 GiB) and the forwards are sized from it as the actor
sizes them; `--max-tokens` sets them instead.

    python -m lab.bench.scorer_profile --teacher DIR --out DIR [--rows 256] [--prompt-tokens 64]
        [--response-tokens 512] [--prompt-min 0] [--response-median 0] [--topk 64] [--chunk 1024]
        [--share-gib 4.94] [--max-tokens 0] [--repeats 3]

`--prompt-min` and `--response-median` give the rows varied lengths (bench/learner.py vary_lengths), as realistic
prompts and rows that stop do (peers.md run 8: the end-to-end scorer was slower a token at 100-320-token prompts and
~150-token responses than at full-length rows).

Writes scorer_profile.json: the command, device and versions, the shape, each timed call's seconds, the median,
scored tokens/s, the forward size the scorer chose, and per phase its device (or CPU) milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

PHASES = ("scorer/forward", "scorer/head", "scorer/support", "scorer/handover")
TOP_KERNELS = 15


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lab.bench.scorer_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, help="the teacher's model directory (config.json + weights)")
    p.add_argument("--out", required=True, help="directory for scorer_profile.json")
    p.add_argument("--rows", type=int, default=256, help="rows of the step (prompts x samples)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens of every prompt")
    p.add_argument("--response-tokens", type=int, default=512, help="tokens of every response")
    p.add_argument(
        "--prompt-min",
        type=int,
        default=0,
        help="prompts of this many up to --prompt-tokens tokens, uniform (0: every prompt --prompt-tokens long)",
    )
    p.add_argument(
        "--response-median",
        type=int,
        default=0,
        help="responses of geometric length with this median, capped at --response-tokens (0: all full length)",
    )
    p.add_argument(
        "--redraw",
        action="store_true",
        help="every call scores rows of newly drawn lengths (new forward shapes, as every step of a run): needs"
        " --prompt-min or --response-median",
    )
    p.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let torch's SDPA use cuDNN (ProcessSettings.cudnn_attention); default flash attention, as a run's actors",
    )
    p.add_argument("--topk", type=int, default=64, help="the teacher's support K (0: the whole vocabulary; -1: none)")
    p.add_argument("--chunk", type=int, default=1024, help="LM-head chunk in response tokens (0: one per forward)")
    p.add_argument("--share-gib", type=float, default=None, help="cap the process at this many GiB (GPU only)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per forward (0: what the share holds)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after one untimed warm-up call")
    p.add_argument("--dtype", default="bfloat16", help="the teacher's dtype (float32 on the CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    for name in ("rows", "prompt_tokens", "response_tokens", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)}: must be >= 1")
    if a.topk < -1:
        p.error(f"--topk={a.topk}: use K >= 1, 0 for the whole vocabulary or -1 for the sampled tokens only")
    if a.chunk < 0 or a.max_tokens < 0:
        p.error("--chunk and --max-tokens must be >= 0 (0: one chunk per forward / what the share holds)")
    if not (Path(a.teacher) / "config.json").is_file():
        p.error(f"--teacher {a.teacher}: no config.json there; give a model directory (scripts/make_random_model.py)")
    if a.prompt_min < 0 or a.prompt_min > a.prompt_tokens or a.response_median < 0:
        p.error(
            f"--prompt-min={a.prompt_min} --response-median={a.response_median}: need 0 <= --prompt-min <="
            f" --prompt-tokens ({a.prompt_tokens}) and --response-median >= 0 (0: fixed lengths)"
        )
    if a.redraw and not (a.prompt_min or a.response_median):
        p.error("--redraw draws new row lengths for every call: give --prompt-min or --response-median too")
    if a.share_gib is not None and not a.device.startswith("cuda"):
        p.error("--share-gib caps GPU memory: leave it out on the CPU")
    if a.share_gib is not None and a.share_gib <= 0:
        p.error(f"--share-gib={a.share_gib}: must be > 0")
    return a


def phase_times(prof, cuda: bool) -> dict[str, float]:
    """Milliseconds of each labelled phase: device time on a GPU (what the kernels under the label took), CPU time
    on the CPU."""
    out = dict.fromkeys(PHASES, 0.0)
    for event in prof.key_averages():
        if event.key in out:
            us = event.device_time_total if cuda else event.cpu_time_total
            out[event.key] += us / 1e3
    return out


def top_kernels(prof, cuda: bool) -> list[dict]:
    events = [e for e in prof.key_averages() if e.key not in PHASES]
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    return [{"name": e.key, "ms": key(e) / 1e3, "calls": e.count} for e in sorted(events, key=key, reverse=True)][
        :TOP_KERNELS
    ]


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    import transformers

    from lab.bench.learner import median_index, synthetic_batch, vary_lengths
    from miniverl.models.packing import row_lengths
    from miniverl.observe.profile import profiling
    from miniverl.process import ProcessSettings
    from miniverl.workers.scorer import ScorerWorker

    cuda = a.device.startswith("cuda")
    process = ProcessSettings(
        a.device, torch_threads=0 if cuda else 1, gpu_memory_gib=a.share_gib, cudnn_attention=a.cudnn_attention
    )
    support = None if a.topk == -1 else a.topk
    row = a.prompt_tokens + a.response_tokens
    print(f"scorer profile: loading {a.teacher} ({a.dtype}, {a.device})", flush=True)
    scorer = ScorerWorker(
        a.teacher,
        a.dtype,
        a.rows,
        process,
        chunk_tokens=a.chunk,
        max_tokens_per_micro_batch=a.max_tokens,
        support_k=support,
        max_row_tokens=row,
    )
    vocab = scorer.model.config.vocab_size
    full = synthetic_batch(a.rows, a.prompt_tokens, a.response_tokens, vocab, seed=0)

    def draw(seed: int):  # rows of varied lengths, as rows that stop and real prompts give (without: every row full)
        return vary_lengths(full, a.prompt_min or a.prompt_tokens, a.response_median, seed=seed)

    batch = draw(0)
    seconds, scored = [], []
    for i in range(1 + a.repeats):  # the first call warms the allocator and the kernels: not timed
        if a.redraw:
            batch = draw(i)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        scorer.score(batch, support, 1.0)
        if cuda:
            torch.cuda.synchronize()
        if i:
            seconds.append(time.perf_counter() - start)
            scored.append(int(batch.response_mask.sum()))
        print(f"scorer profile: call {i + 1} of {1 + a.repeats}: {time.perf_counter() - start:.3f} s", flush=True)
    if a.redraw:  # the profiled call's shapes are new too
        batch = draw(1 + a.repeats)
    with profiling(cuda) as prof:
        scorer.score(batch, support, 1.0)
    middle = median_index(seconds)  # the median call
    median = seconds[middle]
    tokens = scored[-1]
    result = {
        "command": "python -m lab.bench.scorer_profile " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shape": {
            "rows": a.rows,
            "prompt_tokens": a.prompt_tokens,
            "response_tokens": a.response_tokens,
            "prompt_min": a.prompt_min or a.prompt_tokens,
            "response_median": a.response_median,
            "row_tokens": sum(row_lengths(batch)),  # the real tokens the (last, profiled) forwards carry
        },
        "support_k": support,
        "chunk_tokens": a.chunk,
        "forward_tokens": scorer.max_tokens,
        "score_s": seconds,
        "median_score_s": median,
        "redraw": a.redraw,
        "cudnn_attention": a.cudnn_attention,
        "scored_tokens": tokens,  # the last timed call's (every call's without --redraw)
        "scored_tokens_each": scored,
        "tokens_per_s": scored[middle] / median,  # the median call's own rate
        "phases_ms": phase_times(prof, cuda),
        "top_kernels": top_kernels(prof, cuda),
        **scorer.memory(),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scorer_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    phases = ", ".join(f"{k.split('/')[1]} {v:.0f} ms" for k, v in result["phases_ms"].items())
    rate = result["tokens_per_s"]
    print(f"scorer profile: {median:.3f} s for {tokens:,} tokens ({rate:,.0f}/s); {phases}", flush=True)
    return result


if __name__ == "__main__":
    main()
