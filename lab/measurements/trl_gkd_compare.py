"""TRL's GKDTrainer on miniVERL's reference workload shape, for the side-by-side of issue 9.

    python lab/measurements/trl_gkd_compare.py --student /tmp/m/student --teacher /tmp/m/teacher --out trl.json

Same shape as `+experiment=gkd_4080`: a LoRA student (rank 32, every linear layer), on-policy only
(lmbda 1: every batch is the student's own samples), beta 0.5, sampling temperature 1 with no top-k/top-p,
`--prompts` x `--samples` rows of `--max-new-tokens` tokens per optimizer step (the prompts repeated
`--samples` times; `--micro-batch` rows per forward with gradient accumulation over the rest). The models'
chat template is replaced by plain concatenation, so prompts are the same raw text miniVERL's built-in task
feeds. Writes seconds per optimizer step and torch's peak GPU memory to `--out` (JSON); the whole-device
peak comes from nvidia-smi in lab/gpu_qlora.sh.

TRL is not a miniVERL dependency: the device bundle installs it (shared/device/trl.txt, TRL 1.16). Importing
this file imports nothing heavy; bad arguments fail before any model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project, when run as a script

from lab.bench.peer_cell import step_timer

TRL_VERSION = "1.16.0"  # the API read for this script: trl.experimental.gkd.GKDTrainer / GKDConfig
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, help="student model directory")
    ap.add_argument("--teacher", required=True, help="teacher model directory (same tokenizer)")
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per optimizer step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (rows = prompts x samples)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps to time (the first is warm-up)")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="allow a run without CUDA (a smoke test with tiny models)")
    args = ap.parse_args(argv)
    check_args(args, ap)
    return args


def check_args(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Every problem with its fix, before anything is loaded."""
    for name in ("prompts", "samples", "max_new_tokens", "micro_batch", "steps", "lora_rank"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    rows = args.prompts * args.samples
    if rows % args.micro_batch:
        ap.error(f"--micro-batch={args.micro_batch} must divide --prompts x --samples = {rows} rows per step")
    if not 0.0 <= args.beta <= 1.0:
        ap.error(f"--beta={args.beta}: must be in [0, 1]")
    for name in ("student", "teacher"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            ap.error(f"--{name}={getattr(args, name)}: not a model directory (no config.json)")
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA GPU here; run on the GPU machine, or pass --cpu for a smoke test with tiny models")


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` raw-text reversal prompts (the built-in task's format) as ChatML rows; the answer is replaced by
    the student's own sample (lmbda 1)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8)))
        rows.append(
            {"messages": [{"role": "user", "content": f"{word}>"}, {"role": "assistant", "content": word[::-1]}]}
        )
    return rows


def run(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    cuda = torch.cuda.is_available() and not args.cpu
    dtype = torch.bfloat16 if cuda else torch.float32
    tok = AutoTokenizer.from_pretrained(args.student)
    tok.chat_template = PLAIN_CHAT_TEMPLATE
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    rows = args.prompts * args.samples
    prompts = prompt_rows(args.prompts)
    data = Dataset.from_list([p for p in prompts for _ in range(args.samples)] * args.steps)
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=dtype)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=dtype)
    config = GKDConfig(
        output_dir=str(Path(args.out).parent / "trl_run"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lmbda=1.0,
        beta=args.beta,
        temperature=1.0,
        max_new_tokens=args.max_new_tokens,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=cuda,
        use_cpu=not cuda,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    lora = LoraConfig(
        r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear", task_type="CAUSAL_LM"
    )

    timer, step_seconds, _lengths = step_timer(cuda)

    trainer = GKDTrainer(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=data,
        processing_class=tok,
        peft_config=lora,
        callbacks=[timer],
    )
    trainer.train()
    timed = step_seconds[1:] or step_seconds  # the first step compiles kernels and warms the allocator
    result = {
        "trl_version": __import__("trl").__version__,
        "rows_per_step": rows,
        "max_new_tokens": args.max_new_tokens,
        "micro_batch": args.micro_batch,
        "lora_rank": args.lora_rank,
        "beta": args.beta,
        "step_seconds": step_seconds,
        "median_step_seconds": sorted(timed)[len(timed) // 2],
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    }
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
