"""Greedy accuracy of one model on a chat task's held-out problems, asked plainly (the zero-shot student) and with
the teacher's solved demonstrations before each question (the with-context teacher): the two ends of the gap a
distillation run closes. The problems, demonstrations and scoring are the product's own (PromptSource, reward
numeric), so the numbers compare with a run's eval/accuracy on the same data.seed.

A run with model.teacher.path=self and data.teacher_demonstrations now reports the with-context number itself, at
step 0 through its own rollout path (eval/teacher_context_accuracy, summary.json teacher_context_accuracy; see
docs/objectives.md). This script stays to measure both ends without a run (no adapter, no actors, no training
step), and for a model a run cannot decode: a separate teacher only scores.

    PYTHONPATH=. python lab/real_model/teacher_accuracy.py --model smollm2-135m-instruct --out acc.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from miniverl.data.prompts import PromptSource
from miniverl.models.loading import load_causal_lm, load_tokenizer, torch_dtype
from miniverl.rewards.scoring import numeric

CHUNK_ROWS = 125  # rows generated at once: 500 held-out problems in 4 calls


def resolve(path: str, cache_dir: str) -> str:
    """A model directory for `path`: the product's own resolution (short names and .gguf files converted once)."""
    from miniverl.config import DataConfig, ModelConfig, ModelSpec
    from miniverl.setup.prepare import resolve_model_paths

    model = ModelConfig(student=ModelSpec(path=path), teacher=ModelSpec(path=path), cache_dir=cache_dir)
    return resolve_model_paths(model, DataConfig())["student"]


@torch.no_grad()
def greedy_accuracy(model, tok, prompts: list[list[int]], answers: list[str], max_new: int, device: str) -> dict:
    """Greedy answers of `prompts` (left-padded, in chunks), scored by reward numeric against `answers`."""
    correct, finished, lengths, samples = 0, 0, [], []
    eos = tok.eos_token_id
    for start in range(0, len(prompts), CHUNK_ROWS):
        rows = prompts[start : start + CHUNK_ROWS]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tok.pad_token_id or eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id or eos,
        )[:, width:].cpu()
        for i, row in enumerate(out.tolist()):
            stop = row.index(eos) + 1 if eos in row else len(row)
            text = tok.decode(row[:stop], skip_special_tokens=True)
            truth = answers[start + i]
            score = numeric(text, truth)
            correct += score > 0.5
            finished += eos in row
            lengths.append(stop)
            if len(samples) < 4:
                samples.append({"response": text, "ground_truth": truth, "reward": score})
    n = len(prompts)
    return {
        "accuracy": correct / n,
        "stderr": (correct / n * (1 - correct / n) / n) ** 0.5,
        "finished_frac": finished / n,
        "response_length": sum(lengths) / n,
        "rows": n,
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.student.path of the run")
    ap.add_argument("--cache-dir", default="~/.cache/miniverl")
    ap.add_argument("--task", default="addition_chat")
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=500)
    ap.add_argument("--demos", type=int, default=4)
    ap.add_argument("--max-prompt-length", type=int, default=224)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="data.seed of the runs compared")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    path = resolve(args.model, args.cache_dir)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch_dtype(args.dtype, device), device).eval()
    source = PromptSource(
        args.task, args.digits, args.digits, tok, args.max_prompt_length, args.seed, args.eval_prompts, args.demos
    )
    batch = source.eval_batch(args.eval_prompts)
    result = {"model": args.model, "device": device, "eval_prompts": args.eval_prompts, "demos": args.demos}
    for name, prompts in (("zero_shot", batch.prompt_ids), ("with_context", batch.teacher_prompt_ids)):
        result[name] = greedy_accuracy(model, tok, prompts, batch.ground_truth, args.max_new_tokens, device)
        print(f"{name}: greedy accuracy {result[name]['accuracy']:.3f} +- {result[name]['stderr']:.3f}", flush=True)
    result["seconds"] = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
