"""The real-model benchmark's table and plots from its run directories (one per cell and seed, named
`<cell>-s<seed>`, each with the metrics.jsonl and summary.json miniverl writes, or sft.py writes in the same form:
the `sft` cell) and teacher_accuracy.py's json.

    python lab/real_model/report.py RESULTS_DIR        # writes RESULTS_DIR/report.md and accuracy_*.png

Per run: held-out greedy accuracy at every evaluation against the generated tokens and the step time summed so far;
per cell: the mean and standard error over seeds of the end accuracy, the end reverse KL and the share of the gap
closed, (end - start) / (teacher - start), where `teacher` is the with-context teacher's accuracy and `start` the run's
own step-0 accuracy (the zero-shot student's); and every cell's accuracy at one count of generated tokens, the
fewest any finished run generated (each run's evaluations interpolated linearly in tokens): the comparison at equal
generated tokens (OPD against SFT on the teacher's samples).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
from pathlib import Path


def read_run(run: Path) -> dict:
    """{evals: [(step, tokens so far, step seconds so far, accuracy, reverse KL)], summary, step time by phase}."""
    tokens = seconds = 0.0
    evals, phases = [], {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "response_tokens" in m:
            tokens += m["response_tokens"]
            seconds += m.get("time/step", 0.0)
            for k in ("time/generate", "time/score", "time/update", "time/refresh", "time/step"):
                phases.setdefault(k, []).append(m.get(k, 0.0))
        if "eval/accuracy" in m:
            evals.append((m["step"], tokens, seconds, m["eval/accuracy"], m["eval/reverse_kl"]))
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    return {"evals": evals, "summary": summary, "phases": {k: statistics.median(v) for k, v in phases.items()}}


def mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan)


def tokens_to_reach(evals: list[tuple], target: float) -> float:
    """Generated tokens at the first evaluation at or above `target` (nan when never)."""
    return next((tok for _, tok, _, acc, _ in evals if acc >= target), math.nan)


def accuracy_at(evals: list[tuple], tokens: float) -> float:
    """Accuracy interpolated linearly between the evaluations around `tokens` generated tokens (nan past the last)."""
    points = [(tok, acc) for _, tok, _, acc, _ in evals]
    for (t0, a0), (t1, a1) in itertools.pairwise(points):
        if t0 <= tokens <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (tokens - t0) / (t1 - t0)
    return points[0][1] if points and tokens == points[0][0] else math.nan


def main(results: Path) -> str:
    teacher = json.loads((results / "teacher_accuracy.json").read_text())
    zero, ctx = teacher["zero_shot"]["accuracy"], teacher["with_context"]["accuracy"]
    runs = {p.name: read_run(p) for p in sorted((results / "runs").iterdir()) if (p / "metrics.jsonl").exists()}
    cells: dict[str, list[str]] = {}
    for name in runs:
        cells.setdefault(name.rsplit("-s", 1)[0], []).append(name)
    lines = [
        f"Teacher (the base model shown {teacher['demos']} solved demonstrations), greedy on {teacher['eval_prompts']}"
        f" held-out problems: **{ctx:.3f}** +- {teacher['with_context']['stderr']:.3f}; the same model zero-shot"
        f" {zero:.3f} +- {teacher['zero_shot']['stderr']:.3f}.",
        "",
        "| cell | seeds | start acc | end acc (mean +- se) | gap closed (mean +- se; min) | end reverse KL |"
        " generated tokens | step s (gen / score / update) | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    finals, finished = {}, {}
    for cell, names in cells.items():
        ok = [n for n in names if runs[n]["summary"].get("status") == "finished" and runs[n]["evals"]]
        starts = [runs[n]["evals"][0][3] for n in ok]
        ends = [runs[n]["evals"][-1][3] for n in ok]
        kls = [runs[n]["evals"][-1][4] for n in ok]
        gaps = [(e - s) / (ctx - s) if ctx > s else math.nan for s, e in zip(starts, ends)]
        toks = [runs[n]["evals"][-1][1] for n in ok]
        ph = [runs[n]["phases"] for n in ok]
        step = (
            "/".join(
                f"{statistics.fmean(p.get(k, 0.0) for p in ph):.2f}"
                for k in ("time/generate", "time/score", "time/update")
            )
            if ph
            else "-"
        )
        total = f"{statistics.fmean(p.get('time/step', 0.0) for p in ph):.2f}" if ph else "-"
        (s_m, _), (e_m, e_se), (g_m, g_se), (k_m, _) = mean_se(starts), mean_se(ends), mean_se(gaps), mean_se(kls)
        finals[cell] = e_m
        finished[cell] = ok
        status = ", ".join(
            f"{n} {runs[n]['summary'].get('status', 'no summary')} before step {runs[n]['summary'].get('steps', '?')}"
            + (
                f" (last eval: step {runs[n]['evals'][-1][0]}, {runs[n]['evals'][-1][3]:.3f})"
                if runs[n]["evals"]
                else ""
            )
            for n in names
            if n not in ok
        )
        lines.append(
            f"| {cell} | {len(ok)}/{len(names)} | {s_m:.3f} | {e_m:.3f} +- {e_se:.3f} |"
            f" {g_m:.2f} +- {g_se:.2f}; {min(gaps, default=math.nan):.2f} | {k_m:.3f} |"
            f" {statistics.fmean(toks or [0]):,.0f} |"
            f" {total} ({step}) | {status or 'all finished'} |"
        )
    if "grpo" in finals:
        lines += [
            "",
            f"Generated tokens until the first evaluation at or above GRPO's mean end accuracy ({finals['grpo']:.3f}):",
        ]
        for cell, names in cells.items():
            reach = [tokens_to_reach(runs[n]["evals"], finals["grpo"]) for n in names if runs[n]["evals"]]
            lines.append(f"- {cell}: " + ", ".join(f"{t:,.0f}" if not math.isnan(t) else "never" for t in reach))
    reached = [runs[n]["evals"][-1][1] for ok in finished.values() for n in ok]
    if reached:
        budget = min(reached)  # every finished run generated at least this many tokens: none is extrapolated
        lines += ["", f"Held-out accuracy at equal generated tokens ({budget:,.0f}, the fewest of any finished run):"]
        for cell, ok in finished.items():
            m, se = mean_se([accuracy_at(runs[n]["evals"], budget) for n in ok])
            lines.append(f"- {cell}: {m:.3f} +- {se:.3f} ({len(ok)} runs)")
    plot(runs, cells, ctx, zero, results)
    text = "\n".join(lines) + "\n"
    (results / "report.md").write_text(text)
    return text


def plot(runs: dict, cells: dict, teacher: float, zero: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for axis, index, label in (("tokens", 1, "generated tokens"), ("seconds", 2, "step time summed (s)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (cell, names) in enumerate(sorted(cells.items())):
            for j, n in enumerate(names):
                ev = runs[n]["evals"]
                ax.plot(
                    [e[index] for e in ev], [e[3] for e in ev], color=f"C{i}", alpha=0.8, label=cell if j == 0 else None
                )
        ax.axhline(teacher, color="k", ls="--", lw=1, label="teacher (with context)")
        ax.axhline(zero, color="gray", ls=":", lw=1, label="zero-shot")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out greedy accuracy")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"accuracy_{axis}.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))
