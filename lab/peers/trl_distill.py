"""One TRL cell of the peers harness (python -m lab.bench.peers): `trl.DistillationTrainer` at its fastest.

    python lab/peers/trl_distill.py --student S --teacher T --out cell.json --prompts 16 --samples 1 \
        --max-new-tokens 512 --steps 5 [--vllm] [--cpu] [--prompt-len 100:320] [--stop-ids 5,17,...]

TRL 1.16.0 (shared/device/trl.txt). On-policy always (the trainer samples every batch from the student), sampling
at temperature 1 with no top-k/top-p, generalized JSD (--beta) over the full vocabulary through TRL's chunked
divergence kernel; LoRA rank 32 (alpha 64) on every linear layer, as miniVERL's recipe; gradient checkpointing and
bf16 on a GPU (TRL's defaults for this trainer); the whole step is one generation batch (all rows at once) and one
micro-batch of all rows per forward, with `--micro-batch` to split it. `--vllm`: vLLM colocated in this process
(`vllm_mode="colocate"`). Liger's layer kernels (`use_liger_kernel`) when liger_kernel imports and CUDA is there.
Prompts are miniVERL's own training prompts (the reverse task's stream, strings of --prompt-len characters), fed as
raw text. `--stop-ids` end a row besides the student's EOS, in both generation paths (read in TRL 1.16's source):
the student's `generation_config.eos_token_id` becomes the union miniVERL resolves (peer_cell.stop_on), which the
trainer copies into `self.eos_token_ids` (distillation_trainer.py:426-433) for transformers' generate and the mask
after a completion's first EOS (:1091-1095); vLLM's SamplingParams take `stop_token_ids` from
`DistillationConfig.generation_kwargs` (vllm_generation.py:662-683; the engine reads its own EOS from the model's
files, not from the in-memory config), and the completion mask is then the returned lengths (:1578-1587), the stop
token included, as TRL counts an EOS.

Writes step seconds, trained tokens per step (rows x TRL's logged mean completion length) and its settings to
--out. Importing this file imports nothing heavy; bad arguments fail before any model loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project, when run as a script

from lab.bench.peer_cell import (
    add_harness_options,
    apply_attention,
    run_cell,
    step_timer,
    stop_on,
    time_generation,
    trained_tokens_per_step,
)
from lab.bench.peer_prompts import PLAIN_CHAT_TEMPLATE, step_prompts

LORA_RANK = 32  # miniVERL's gkd_4080 recipe: rank 32, alpha 64, every linear layer
LEARNING_RATE = 1e-4
VLLM_MEMORY_SHARE = 0.3  # TRL's default vllm_gpu_memory_utilization for the colocated engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, type=Path)
    ap.add_argument("--teacher", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per forward (0: all rows of the step)")
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--vllm", action="store_true", help="generate with vLLM colocated (vllm_mode='colocate')")
    ap.add_argument("--cpu", action="store_true", help="allow a run without CUDA (tiny models)")
    add_harness_options(ap)
    args = ap.parse_args(argv)
    for name in ("prompts", "samples", "max_new_tokens", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    rows = args.prompts * args.samples
    args.micro_batch = args.micro_batch or rows
    if rows % args.micro_batch:
        ap.error(f"--micro-batch={args.micro_batch} must divide --prompts x --samples = {rows} rows per step")
    if not 0.0 <= args.beta <= 1.0:
        ap.error(f"--beta={args.beta}: must be in [0, 1]")
    if args.vllm and args.cpu:
        ap.error("--vllm needs CUDA; drop --cpu or --vllm")
    return args


def generation_kwargs(args: argparse.Namespace) -> dict | None:
    """DistillationConfig.generation_kwargs: the stop ids for vLLM's SamplingParams; None otherwise (TRL's default).
    transformers' generate stops on the model's EOS list instead (stop_on): TRL also merges these kwargs into its
    GenerationConfig (distillation_trainer.py:755-757), where `stop_token_ids` means nothing."""
    return {"stop_token_ids": list(args.stop_ids)} if args.vllm and args.stop_ids else None


def run(args: argparse.Namespace) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    cuda = torch.cuda.is_available() and not args.cpu
    attention = apply_attention(args)
    dtype = torch.bfloat16 if cuda else torch.float32
    tok = AutoTokenizer.from_pretrained(args.student)
    tok.chat_template = PLAIN_CHAT_TEMPLATE
    rows = args.prompts * args.samples
    # each optimizer step's prompts, each repeated --samples times (TRL samples one completion per row)
    prompts = step_prompts(args.prompts, args.steps, args.samples, args.prompt_len)
    data = [{"prompt": [{"role": "user", "content": p}]} for p in prompts]
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=dtype)
    eos = stop_on(student, tok, args.stop_ids) if args.stop_ids else None
    liger = cuda and importlib.util.find_spec("liger_kernel") is not None
    settings = {
        "trainer": "trl.DistillationTrainer",
        "use_vllm": args.vllm,
        "vllm_mode": "colocate" if args.vllm else None,
        "vllm_gpu_memory_utilization": VLLM_MEMORY_SHARE if args.vllm else None,
        "use_liger_kernel": liger,
        "gradient_checkpointing": cuda,
        "bf16": cuda,
        "micro_batch": args.micro_batch,
        "gradient_accumulation_steps": rows // args.micro_batch,
        "lora": f"r{LORA_RANK} alpha {2 * LORA_RANK} all-linear",
        "beta": args.beta,
        "temperature": 1.0,
        "prompt_len": list(args.prompt_len),
        "stop_ids": len(args.stop_ids),
        "eos_token_ids": len(eos) if eos else None,  # the student's EOS list, stops included (None: its own)
        "vllm_stop_token_ids": len(args.stop_ids) if generation_kwargs(args) else None,
        "attention": attention,  # the training forwards' SDPA (vLLM's generation has its own)
    }
    config = DistillationConfig(
        output_dir=str(args.out.parent / f"{args.out.stem}_trl"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,
        max_steps=args.steps,
        learning_rate=LEARNING_RATE,
        beta=args.beta,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_completion_length=args.max_new_tokens,
        use_vllm=args.vllm,
        vllm_mode="colocate",
        generation_kwargs=generation_kwargs(args),
        vllm_gpu_memory_utilization=VLLM_MEMORY_SHARE,
        use_liger_kernel=liger,
        gradient_checkpointing=cuda,
        bf16=cuda,
        use_cpu=not cuda,
        shuffle_dataset=False,  # step s trains on step s's prompts, as miniVERL does
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    timer, step_seconds, mean_lengths = step_timer(cuda)

    trainer = DistillationTrainer(
        model=student,
        teacher_model=AutoModelForCausalLM.from_pretrained(args.teacher, dtype=dtype),
        args=config,
        train_dataset=Dataset.from_list(data),
        processing_class=tok,
        peft_config=LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear"),
        callbacks=[timer],
    )
    generation = time_generation(trainer, timer, cuda)
    trainer.train()
    return {
        "prompts": args.prompts,
        "samples": args.samples,
        "step_seconds": step_seconds,
        "generate_seconds": generation,
        "trained_tokens_per_step": trained_tokens_per_step(rows, mean_lengths, args.max_new_tokens),
        "mean_lengths": mean_lengths,  # per step, as logged: rows x these are the steps' trained tokens
        "length_ranges": timer.ranges,  # per step, the shortest and longest completion
        "settings": settings,
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    }


def main(argv: list[str] | None = None) -> None:
    run_cell(parse_args, run, argv)


if __name__ == "__main__":
    main()
