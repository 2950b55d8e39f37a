"""CLI: python -m miniverl.bridge {export-verl,export-data} ... (see --help)."""

from __future__ import annotations

import argparse
import sys

from miniverl.bridge.checks import VERL_ROLLOUT_ENGINES
from miniverl.bridge.versions import DEFAULT_VERL_VERSION, SUPPORTED_VERL_VERSIONS
from miniverl.errors import MiniVerlError

REFUSALS_HELP = f"""\
The export fails closed: it first collects every reason verl {DEFAULT_VERL_VERSION} could not reproduce the
run, prints them all and writes nothing. It refuses:
  verl_version          a --verl-version other than {", ".join(SUPPORTED_VERL_VERSIONS)} (keys verified against it)
  rollout_backend       rollout.backend other than {", ".join(VERL_ROLLOUT_ENGINES)} (hf_reference, hf_cached)
  quantized_student     an NF4/QLoRA student (model.student.quantization)
  teacher_colocated     resources.scorer_gpus=0: verl runs the teacher in its own GPU pool
  multi_teacher         model.teachers (a teacher per data source): verl 0.9.1 routes one source per teacher
                        entry, with no default and GPUs per teacher; this bridge does not translate it yet
  no_gpus               resources.gpus=0 (a CPU-only run)
  gkd_loss              gkd with beta > 0: verl has no generalized JSD or full reverse KL
  gkd_support           gkd with a top-K teacher support (verl drops the tail) or an unknown vocabulary size
  gkd_temperature       gkd with a loss or sampling temperature other than 1
  pg_discount           pg_k1 with objective.discount > 0
  pg_kl_in_advantage    pg_k1 with objective.kl_coef > 0
  pg_reward_weight      pg_k1 with objective.reward_coef other than 0 or 1
  pg_teacher_weight     pg_k1 with objective.teacher_coef other than 1 (e.g. 0: GRPO on the task reward alone)
  teacher_context       data.teacher_demonstrations > 0: verl's teacher scores the student's own prompt
  teacher_self          model.teacher.path=self: verl loads a teacher model of its own
  staleness             trainer.staleness=1: verl 0.9.1's one-step-off-policy trainer has no distillation
  lora                  LoRA dropout, a fractional alpha, or a rank vLLM cannot serve
  batch_sizes           samples per step that do not split evenly over GPUs and micro-batches
  stop_token_ids        rollout.stop_token_ids: verl 0.9.1 has no stop-token setting (use generation_config)
  reward_function       a data_source of the exported rows with no reward (reward.name / by_source), or a
                        reward that is not one of miniverl/rewards/scoring.py (exported as compute_score)
  reward_signature      reward.custom_function whose parameters are not verl's (data_source, solution_str,
                        ground_truth, extra_info): verl calls it by keyword
  prompt_tokens         a student tokenizer that adds more than a BOS to a raw prompt, a chat_template=true
                        run whose tokenizer has no template, or no local tokenizer to inspect
An existing --out is never overwritten; output is written to a hidden temporary directory and renamed
into place only when complete. docs/bridge.md has the full correspondence of settings.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miniverl.bridge",
        description="Carry a miniVERL run to verl, or refuse with every reason it cannot.",
        epilog=REFUSALS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ev = sub.add_parser(
        "export-verl",
        help="a run as verl main_ppo overrides (YAML + command line), reward and data",
        epilog=REFUSALS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument("source", help="a run directory (outputs/<date>/<time>) or a composed config YAML")
    ev.add_argument("--out", required=True, help="new directory to write (must not exist)")
    ev.add_argument("--verl-version", default=DEFAULT_VERL_VERSION, help="the verl release to target")
    ed = sub.add_parser("export-data", help="prompt data alone as verl parquet (train.parquet, test.parquet)")
    ed.add_argument("source", nargs="?", help="a run directory or composed config YAML (its prompts)")
    ed.add_argument("--jsonl", help="instead of a run: a jsonl file with one prompt and one answer per line")
    ed.add_argument("--prompt-key", default="prompt", help="the jsonl column holding the prompt text")
    ed.add_argument("--answer-key", default="answer", help="the jsonl column holding the answer")
    ed.add_argument("--out", required=True, help="new directory to write (must not exist)")
    args = parser.parse_args(argv)

    from miniverl.bridge.export import export_data, export_verl

    try:
        if args.command == "export-verl":
            out = export_verl(args.source, args.out, args.verl_version)
        else:
            out = export_data(args.out, args.source, args.jsonl, args.prompt_key, args.answer_key)
    except MiniVerlError as e:
        print(f"miniverl.bridge: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
