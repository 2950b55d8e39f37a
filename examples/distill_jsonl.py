"""Distil a student on your own prompts: a jsonl file with one prompt and its answer per line.

    python examples/distill_jsonl.py prompts.jsonl --student DIR_OR_HUB_ID --teacher DIR_OR_HUB_ID [--steps 50]

Each line is `{"prompt": "...", "answer": "..."}` (other column names: --prompt-key/--answer-key;
--answer-key '' for prompts without answers; a prompt may also be a list of chat messages). Prompts go
through the student's chat template, 16 of them are held out for evaluation, and answers are scored by
exact match unless a line carries a data_source with its own reward (README: rewards). It is the same run as

    python -m miniverl.main +experiment=gkd data.train_files=[prompts.jsonl] model.student.path=...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from miniverl.config import register_configs, to_config
from miniverl.errors import MiniVerlError, message_of
from miniverl.main import train

CONF = Path(__file__).resolve().parents[1] / "conf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts")
    ap.add_argument("--student", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt-key", default="prompt")
    ap.add_argument("--answer-key", default="answer")
    ap.add_argument("--out", default="outputs/distill_jsonl")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. rollout.max_new_tokens=64")
    args = ap.parse_intermixed_args()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose(
            config_name="config",
            overrides=[
                "+experiment=gkd",
                f"data.train_files=[{Path(args.prompts).resolve()}]",
                f"data.prompt_key={args.prompt_key}",
                f"data.answer_key={args.answer_key}",
                "data.eval_prompts=16",
                "data.max_prompt_length=256",
                f"model.student.path={args.student}",
                f"model.teacher.path={args.teacher}",
                f"trainer.total_steps={args.steps}",
                *args.overrides,
            ],
        )
    run_dir = Path(args.out)
    try:  # a bad input is one line, as python -m miniverl.main prints it, not a traceback
        summary = train(to_config(raw), run_dir, OmegaConf.to_container(raw, resolve=True))
    except MiniVerlError as e:
        sys.exit(f"distill_jsonl: error: {message_of(e)}")
    print(f"reverse KL to the teacher: {summary['start_reverse_kl']:.4f} -> {summary['end_reverse_kl']:.4f}")
    print(f"greedy accuracy: {summary['start_accuracy']:.3f} -> {summary['end_accuracy']:.3f}")
    last = (run_dir / "samples.jsonl").read_text().splitlines()[-1]
    print("a sample from the last evaluation:", json.dumps(json.loads(last), indent=1))


if __name__ == "__main__":
    main()
