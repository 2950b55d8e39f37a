"""Preregistered benchmarks: `python -m lab.bench +bench=<name>` runs lab/conf/bench/<name>.yaml.

A bench file fixes, before any run, the cells (backend x generation length x prompts x samples), the
model shape, repeats and warm-up, and the rules that invalidate a cell. Every cell is reported: valid
with its numbers, invalid with its reasons, or not run with why; none is dropped or shown as zero.

    workload.py      the model, adapter, prompts and seeds every backend gets
    runner.py        one backend at a time: warm-up, timed repeats, memory, time cap, OOM
    oracle.py        teacher-forced log-probs of each cell's samples under the oracle
    invalidation.py  the rules, as plain functions
    report.py        JSON + markdown under lab/results/
"""
