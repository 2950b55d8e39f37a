"""The fit planner against MOPD run 2's measured peaks (lab/results/mopd-gpu/run2, session 38, issue 35).

Those cells ran before runs recorded their plan in summary.json, so each cell's plan is recomputed here from the
overrides lab/gpu_mopd.sh and lab/e2e_cell.sh gave it (the shares it printed are checked against the ones
recomputed), on models of the same shapes, and set against the cell's measured peaks with bench/e2e_report.py
plan_check. A second plan per cell keeps the run's shares and sizes but takes data.max_prompt_length at the longest
prompt the run drew: the plan's own model at the rows that ran, apart from its worst case (every prompt 320 tokens).

    python scripts/make_random_model.py --shape qwen2.5-0.5b --out /tmp/m/student   # (and qwen2.5-1.5b teacher_a)
    PYTHONPATH=. python lab/measurements/mopd_plan_check.py lab/results/mopd-gpu/run2 /tmp/m

MODELS needs student/, teacher_a/ to teacher_d/ (one model linked four times will do: only the shapes count) and the
four-source prompt file four_sources.jsonl that lab/gpu_mopd.sh writes (its eval split sizes the rollout's
evaluation rows). Writes <run dir>/plan_check.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from lab.bench.e2e_report import plan_check, read_cell
from miniverl.config import register_configs, to_config
from miniverl.data.build import build_prompt_source
from miniverl.fit import plan_run
from miniverl.main import CONF
from miniverl.models.loading import load_tokenizer

SHARES = ["resources.rollout.num_gpus", "resources.scorer.num_gpus", "resources.learner.num_gpus"]


def overrides(models: str, cell: str, steps: int) -> list[str]:
    """The cell's command line as gpu_mopd.sh and e2e_cell.sh built it (shares left to the plan)."""
    teachers = {
        "single-nf4": [f"model.teacher.path={models}/teacher_a", "model.teacher.quantization=nf4"],
        "single-bf16": [f"model.teacher.path={models}/teacher_a"],
        "two-nf4": [
            "model.teacher.path=builtin:teacher",
            f"+model.teachers={{reverse:{{path:{models}/teacher_a,quantization:nf4}},"
            f"sort:{{path:{models}/teacher_b,quantization:nf4}}}}",
            "+model.teacher_by_source={reverse:reverse,sort:sort}",
        ],
        "four-nf4": [
            "model.teacher.path=builtin:teacher",
            f"data.train_files=[{models}/four_sources.jsonl]",
            "data.chat_template=false",
            "+model.teachers={" + ",".join(f"{t}:{{path:{models}/teacher_{t},quantization:nf4}}" for t in "abcd") + "}",
            "+model.teacher_by_source={src_a:a,src_b:b,src_c:c,src_d:d}",
            "+reward.by_source={src_a:exact_match,src_b:exact_match,src_c:exact_match,src_d:exact_match}",
        ],
    }
    name, tag = cell.removeprefix("mopd-").rsplit("-", 1)
    rows = ["data.prompts_per_step=16"] if tag == "16x4" else []
    return [
        "+experiment=gkd_4080",
        f"model.student.path={models}/student",
        "data.eval_prompts=8",
        "trainer.eval_every=0",
        f"trainer.total_steps={steps}",
        "trainer.save_checkpoint=false",
        "resources.emulate_gpu_gib=16",
        "data.train_files=[]",
        "data.task=reverse+sort",
        "trainer.micro_batch_size=4",
        *teachers[name],
        *rows,
        *(f"{k}=null" for k in SHARES),
    ]


def composed(argv: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return to_config(compose(config_name="config", overrides=argv))


def longest_prompt(cfg, models: str) -> int:
    """The longest prompt, in tokens, of the steps and the evaluation the run drew (the stream is a pure function of
    the seed and step)."""
    source = build_prompt_source(
        cfg.data, load_tokenizer(f"{models}/student", "student", ""), cfg.trainer.total_steps, log=lambda *_: None
    )
    batches = [source.batch(s, cfg.data.prompts_per_step) for s in range(cfg.trainer.total_steps)]
    batches.append(source.eval_batch(cfg.data.eval_prompts))
    return max(len(p) for b in batches for p in b.prompt_ids)


def main(run_dir: Path, models: str) -> None:
    register_configs()
    quiet = lambda *_: None  # noqa: E731
    results = []
    for summary_file in sorted(run_dir.glob("mopd-*_summary.json")):
        cell = summary_file.name.removesuffix("_summary.json")
        summary = json.loads(summary_file.read_text())
        argv = overrides(models, cell, summary["steps"])
        cfg = composed(argv)
        plan = plan_run(cfg, log=quiet)
        chosen = {k: v for k, v in plan.layout.items() if k.startswith("resources.")}
        ran = {k: v for k, v in summary["chosen"].items() if k.startswith("resources.")}
        if chosen != ran:
            raise SystemExit(f"{cell}: recomputed shares {chosen} are not the ones the run chose {ran}")
        longest = longest_prompt(cfg, models)
        at_drawn = plan_run(
            composed(argv + [f"{k}={v}" for k, v in chosen.items()] + [f"data.max_prompt_length={longest}"]), log=quiet
        )
        smi = read_cell(run_dir, cell)["smi_peak_gib"]
        record = plan.record()
        results.append(
            {
                "cell": cell,
                "plan": record,
                "check": plan_check(record, summary["memory"], smi),
                "longest_prompt_tokens": longest,
                "check_at_drawn_prompts": plan_check(at_drawn.record(), summary["memory"], smi),
            }
        )
        drawn = results[-1]["check_at_drawn_prompts"]
        line = ", ".join(
            f"{role} {v['modelled_gib']:.2f}/{v['measured_gib']:.2f} ({v['error_pct']:+.1f}%; at drawn prompts "
            f"{drawn[role]['error_pct']:+.1f}%)"
            for role, v in results[-1]["check"].items()
            if v["error_pct"] is not None  # an engine's rollout, a run without nvidia-smi samples: nothing to set
        )
        print(f"{cell}: {line}", flush=True)
    (run_dir / "plan_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2].rstrip("/"))
