"""The Unsloth cell of the peers harness (python -m miniverl.bench.peers): Unsloth's GRPO at its recommended settings.

    python scripts/peers/unsloth_grpo.py --student S --out cell.json --prompts 8 --samples 2 --max-new-tokens 512 \
        --steps 5

Unsloth 2026.10.9 with TRL 1.15.0 (scripts/device/unsloth.txt, installed in a site of its own: Unsloth pins trl
<= 1.15.0, transformers <= 5.17.0 and datasets < 5). As Unsloth's GRPO notebooks set it up: `FastLanguageModel`
with `load_in_4bit=True` (its QLoRA; --bf16 for a 16-bit base), `fast_inference=True` (vLLM generation, the
adapter served by Unsloth's own LoRA path), `max_lora_rank` = the rank, `gpu_memory_utilization` 0.6;
`get_peft_model` on the seven projections with `use_gradient_checkpointing="unsloth"`; TRL's GRPOTrainer as
Unsloth patches it, `optim="adamw_8bit"`, lr 5e-6. Sampling at temperature 1, no top-k/top-p; `--samples`
generations per prompt (GRPO's group); the reward is the reverse task's exact match (miniverl.rewards.scoring), the
same task reward miniVERL's pg_k1 cell adds. One step = all rows (`--micro-batch` splits the update).

`import unsloth` must come before trl and transformers (it patches them): run() imports it first. Importing this
file imports nothing heavy; bad arguments fail before any model loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project, when run as a script

from miniverl.bench.peer_cell import run_cell, step_timer, time_generation, trained_tokens_per_step
from miniverl.bench.peer_prompts import step_examples

LORA_RANK = 32
LEARNING_RATE = 5e-6  # Unsloth's GRPO notebooks
VLLM_MEMORY_SHARE = 0.6  # Unsloth's GRPO notebooks' gpu_memory_utilization
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT_TOKENS_MAX = 64  # the reverse task's prompts are a few tokens; the engine's context = this + new tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--samples", type=int, required=True, help="GRPO's group size (num_generations), >= 2")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per update forward (0: all rows)")
    ap.add_argument("--bf16", action="store_true", help="a 16-bit base instead of Unsloth's 4-bit default")
    args = ap.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.samples < 2:
        ap.error(f"--samples={args.samples}: GRPO needs groups of 2 or more (run P/2 x 2 for the same rows)")
    rows = args.prompts * args.samples
    args.micro_batch = args.micro_batch or rows
    if rows % args.micro_batch or args.micro_batch % args.samples:
        ap.error(f"--micro-batch={args.micro_batch} must divide {rows} rows and hold whole groups of {args.samples}")
    return args


def run(args: argparse.Namespace) -> dict:
    import unsloth  # noqa: I001  (first: it patches trl and transformers on import)
    from unsloth import FastLanguageModel

    import torch
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from miniverl.rewards.scoring import exact_match

    model, tok = FastLanguageModel.from_pretrained(
        model_name=str(args.student),
        max_seq_length=PROMPT_TOKENS_MAX + args.max_new_tokens,
        load_in_4bit=not args.bf16,
        fast_inference=True,
        max_lora_rank=LORA_RANK,
        gpu_memory_utilization=VLLM_MEMORY_SHARE,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        target_modules=PROJECTIONS,
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )
    rows = args.prompts * args.samples
    data = Dataset.from_list([{"prompt": p, "answer": a} for p, a in step_examples(args.prompts, args.steps)])

    def reverse_reward(completions, answer, **_kwargs) -> list[float]:
        return [exact_match(c, a) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=str(args.out.parent / f"{args.out.stem}_unsloth"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,
        num_generations=args.samples,
        max_completion_length=args.max_new_tokens,
        max_steps=args.steps,
        learning_rate=LEARNING_RATE,
        optim="adamw_8bit",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=True,
        shuffle_dataset=False,
        bf16=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    timer, step_seconds, mean_lengths = step_timer(True)

    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=[reverse_reward],
        args=config,
        train_dataset=data,
        callbacks=[timer],
    )
    generation = time_generation(trainer, timer, True)
    trainer.train()
    return {
        "prompts": args.prompts,
        "samples": args.samples,
        "step_seconds": step_seconds,
        "generate_seconds": generation,
        "trained_tokens_per_step": trained_tokens_per_step(rows, mean_lengths, args.max_new_tokens),
        "settings": {
            "trainer": "unsloth FastLanguageModel + trl.GRPOTrainer",
            "load_in_4bit": not args.bf16,
            "fast_inference (vLLM)": True,
            "gpu_memory_utilization": VLLM_MEMORY_SHARE,
            "use_gradient_checkpointing": "unsloth",
            "lora": f"r{LORA_RANK} alpha {2 * LORA_RANK} {'/'.join(PROJECTIONS)}",
            "optim": "adamw_8bit",
            "micro_batch": args.micro_batch,
            "num_generations": args.samples,
        },
        "versions": {"unsloth": unsloth.__version__, "trl": trl.__version__, "torch": torch.__version__},
        "device": torch.cuda.get_device_name(0),
    }


def main(argv: list[str] | None = None) -> None:
    run_cell(parse_args, run, argv)


if __name__ == "__main__":
    main()
