"""Greedy accuracy of the built-in mixture student and of trained adapters on fresh prompts of each task.

    python lab/measurements/mopd_fresh_accuracy.py RUN_DIR/checkpoints/step_00000400/adapter [more adapters ...]

A run's evaluation holds 64-256 prompts per task; this draws 1024 per task (a seed of their own, so they are
not the held-out set) and splits sorting by whether the answer repeats a letter, the case that the diagnosis in
lab/results/mopd-cpu.md found unlearned. The base student is the first line.
"""

from __future__ import annotations

import argparse
import copy
import random

import torch

from miniverl.config import DataConfig
from miniverl.data.tasks import draw_examples
from miniverl.models.builtin import BuiltinRecipe, builtin_dir, greedy_answers

FRESH_PROMPTS = 1024  # per task: a standard error of ~0.01 at accuracy 0.86
FRESH_SEED = 123


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("adapters", nargs="*")
    parser.add_argument("--cache-dir", default="~/.cache/miniverl")
    args = parser.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = DataConfig()
    student_dir = builtin_dir(args.cache_dir, BuiltinRecipe("reverse+sort", d.min_len, d.max_len)) / "student"
    tok = AutoTokenizer.from_pretrained(str(student_dir))
    base = AutoModelForCausalLM.from_pretrained(str(student_dir)).eval()
    tasks = {
        name: [ex for _, ex in draw_examples(name, random.Random(FRESH_SEED), d.min_len, d.max_len, FRESH_PROMPTS)]
        for name in ("sort", "reverse")
    }
    for path in ["base", *args.adapters]:
        model = base if path == "base" else PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
        line = []
        with torch.no_grad():
            for name, examples in tasks.items():
                answers = greedy_answers(model, tok, [ex.prompt for ex in examples], d.max_len * 2)
                right = [a == ex.answer for a, ex in zip(answers, examples)]
                line.append(f"{name} {sum(right) / len(right):.3f}")
                if name == "sort":
                    repeated = [r for r, ex in zip(right, examples) if len(set(ex.answer)) < len(ex.answer)]
                    line[-1] += f" (answers with a repeated letter: {sum(repeated) / len(repeated):.3f})"
        print(f"{path}: " + ", ".join(line))


if __name__ == "__main__":
    main()
