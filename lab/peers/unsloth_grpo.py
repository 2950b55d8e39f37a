"""The Unsloth cell of the peers harness (python -m lab.bench.peers): Unsloth's GRPO at its recommended settings.

    python lab/peers/unsloth_grpo.py --student S --out cell.json --prompts 8 --samples 2 --max-new-tokens 512 \
        --steps 5 [--prompt-len 100:320] [--stop-ids 5,17,...]

Unsloth 2026.10.9 with TRL 1.15.0 (lab/device/unsloth.txt, installed in a site of its own: Unsloth pins trl
<= 1.15.0, transformers <= 5.17.0 and datasets < 5). As Unsloth's GRPO notebooks set it up: `FastLanguageModel`
with `load_in_4bit=True` (its QLoRA; --bf16 for a 16-bit base), `fast_inference=True` (vLLM generation, the
adapter served by Unsloth's own LoRA path), `max_lora_rank` = the rank, `gpu_memory_utilization` 0.6;
`get_peft_model` on the seven projections with `use_gradient_checkpointing="unsloth"`; TRL's GRPOTrainer as
Unsloth patches it, `optim="adamw_8bit"`, lr 5e-6. Sampling at temperature 1, no top-k/top-p; `--samples`
generations per prompt (GRPO's group); the reward is the reverse task's exact match (miniverl.rewards.scoring), the
same task reward miniVERL's pg_k1 cell adds. One step = all rows (`--micro-batch` splits the update). Prompts are
miniVERL's training stream at --prompt-len; the engine's context (`max_seq_length`) holds the longest such prompt
and the new tokens.

`--stop-ids` end a row besides the model's EOS (read in TRL 1.15's and Unsloth 2026.10.9's source). Generation:
TRL's VLLMGeneration builds vLLM's SamplingParams from `GRPOConfig.generation_kwargs` (trl/generation/
vllm_generation.py:662-683; Unsloth's generate wrapper, unsloth/models/rl_replacements.py:5624-5640, routes them
through grpo_update_SamplingParams only when `vllm_sampling_params` is set, which is not), so they carry
`stop_token_ids`. The mask: GRPO 1.15 masks a vLLM completion by its returned length (grpo_trainer.py:2379-2388,
the stop token included), not after a first `eos_token_id`; but `self.eos_token_ids`, read from the model's
`generation_config.eos_token_id` (:398-405), decides which rows count as truncated (the clipped ratio it logs, :2227,
and `mask_truncated_completions`, :2414-2418, which zeroes truncated rows: off here, as Unsloth resolves it for the
default loss, rl.py:3576), so the model's EOS list gets the stops too (peer_cell.stop_on), as miniVERL's union.

`import unsloth` must come before trl and transformers (it patches them): run() imports it first. Importing this
file imports nothing heavy; bad arguments fail before any model loads.
"""

from __future__ import annotations

import argparse
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
from lab.bench.peer_prompts import longest_prompt_tokens, step_examples

LORA_RANK = 32
LEARNING_RATE = 5e-6  # Unsloth's GRPO notebooks
VLLM_MEMORY_SHARE = 0.6  # Unsloth's GRPO notebooks' gpu_memory_utilization
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the engine's context for the prompt: at least this (the default 3-8 character prompts are a few tokens), or the
# longest --prompt-len prompt; the context is that + the new tokens
PROMPT_TOKENS_MAX = 64


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
    add_harness_options(ap)
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


def stop_kwargs(args: argparse.Namespace) -> dict:
    """GRPOConfig's keyword for the stop ids (generation_kwargs, for vLLM's SamplingParams); none without them, so
    the config keeps the default Unsloth gives it."""
    return {"generation_kwargs": {"stop_token_ids": list(args.stop_ids)}} if args.stop_ids else {}


def run(args: argparse.Namespace) -> dict:
    import unsloth  # noqa: I001  (first: it patches trl and transformers on import)
    from unsloth import FastLanguageModel

    import torch
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from transformers import AutoTokenizer

    from miniverl.rewards.scoring import exact_match

    attention = apply_attention(args)

    prompt_tokens = max(
        PROMPT_TOKENS_MAX, longest_prompt_tokens(args.prompt_len[1], AutoTokenizer.from_pretrained(args.student))
    )
    model, tok = FastLanguageModel.from_pretrained(
        model_name=str(args.student),
        max_seq_length=prompt_tokens + args.max_new_tokens,
        load_in_4bit=not args.bf16,
        fast_inference=True,
        max_lora_rank=LORA_RANK,
        gpu_memory_utilization=VLLM_MEMORY_SHARE,
    )
    eos = stop_on(model, tok, args.stop_ids) if args.stop_ids else None
    model = FastLanguageModel.get_peft_model(
        model,
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        target_modules=PROJECTIONS,
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )
    rows = args.prompts * args.samples
    examples = step_examples(args.prompts, args.steps, args.prompt_len)
    data = Dataset.from_list([{"prompt": p, "answer": a} for p, a in examples])

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
        **stop_kwargs(args),
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
        "mean_lengths": mean_lengths,  # per step, as logged: rows x these are the steps' trained tokens
        "length_ranges": timer.ranges,  # per step, the shortest and longest completion
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
            "max_seq_length": prompt_tokens + args.max_new_tokens,
            "prompt_len": list(args.prompt_len),
            "stop_ids": len(args.stop_ids),
            "eos_token_ids": len(eos) if eos else None,  # the model's EOS list, stops included (None: its own)
            "attention": attention,  # torch's SDPA where Unsloth's training attention calls it (vLLM has its own)
        },
        "versions": {"unsloth": unsloth.__version__, "trl": trl.__version__, "torch": torch.__version__},
        "device": torch.cuda.get_device_name(0),
    }


def main(argv: list[str] | None = None) -> None:
    run_cell(parse_args, run, argv)


if __name__ == "__main__":
    main()
