"""miniverl.bench.peers (issue 34's peers harness): import-safe, refuses bad arguments before anything runs, and
records a peer that is missing or cannot run here as a failed cell with its reason instead of crashing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miniverl.bench import peers
from miniverl.bench.peer_prompts import step_examples, step_prompts
from miniverl.data.prompts import held_out_prompts

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("trl", "unsloth", "vllm", "datasets")


def test_importing_the_harness_and_its_cell_scripts_imports_no_peer():
    code = (
        "import runpy, sys; import miniverl.bench.peers, miniverl.bench.peer_prompts\n"
        "for s in ('trl_distill', 'unsloth_grpo'): runpy.run_path(f'scripts/peers/{s}.py', run_name='x')\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def args(student, teacher, out, *extra) -> list[str]:
    return ["--student", str(student), "--teacher", str(teacher), "--out", str(out), *extra]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--shapes", "16x1"], "write PROMPTS x SAMPLES x TOKENS"),
        (["--shapes", "16x0x512"], "write PROMPTS x SAMPLES x TOKENS"),
        (["--cells", "trl-distill-hf,nope"], "unknown nope"),
        (["--steps", "1"], "--steps=1: need more than the 1 warm-up"),
        (["--unsloth-site", "/nonexistent/site"], "unpack the unsloth bundle there first"),
    ],
)
def test_bad_arguments_name_the_fix(student_dir, teacher_dir, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        peers.parse_args(args(student_dir, teacher_dir, tmp_path, "--cpu", *extra))
    assert message in capsys.readouterr().err


def test_missing_model_and_missing_gpu_are_refused(student_dir, tmp_path, capsys):
    import torch

    with pytest.raises(SystemExit):
        peers.parse_args(args(student_dir, tmp_path, tmp_path, "--cpu"))
    assert "not a model directory" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            peers.parse_args(args(student_dir, student_dir, tmp_path))
        assert "pass --cpu for a smoke test" in capsys.readouterr().err


def test_shapes_and_grpo_groups():
    shape = peers.parse_shape("16x1x512")
    assert (shape.rows, shape.name) == (16, "16x1x512")
    assert shape.grouped() == peers.Shape(8, 2, 512)  # GRPO's groups of two: the same rows and tokens
    assert peers.parse_shape("64x4x512").grouped() == peers.Shape(64, 4, 512)
    with pytest.raises(ValueError, match="odd"):
        peers.Shape(3, 1, 8).grouped()


@pytest.mark.parametrize(
    "returncode, lines, expected",
    [
        (None, [], "timed out after 9 s"),
        (1, ["x", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20 GiB", "y"], "out of memory: torch"),
        (1, ["ModuleNotFoundError: No module named 'xformers'"], "missing module xformers (exit 1)"),
        (2, ["ValueError: bad thing", "  during handling"], "exit 2: ValueError: bad thing"),
    ],
)
def test_failure_reasons(returncode, lines, expected):
    assert peers.failure_reason(returncode, lines, 9).startswith(expected)


def test_peers_draw_miniverls_training_prompts_without_the_held_out_ones():
    examples = step_examples(prompts=4, steps=3)
    assert len(examples) == 12 and all(a == p[:-1][::-1] for p, a in examples)  # reverse task: "abc>" -> "cba"
    held_out = held_out_prompts(peers.TASK, peers.TASK_MIN_LEN, peers.TASK_MAX_LEN, peers.DATA_SEED, 8)
    assert not {p for p, _ in examples} & held_out
    assert step_prompts(4, 1, 2) == [p for p, _ in examples[:4] for _ in range(2)]
    assert step_examples(4, 1) == examples[:4]  # a step's prompts do not depend on how many steps are drawn


def test_miniverl_run_is_read_from_its_metrics(tmp_path):
    rows = [{"step": 0, "accuracy": 0.1}] + [
        {"step": s, "time/step": t, "time/generate": t / 4, "response_tokens": n}
        for s, t, n in [(1, 9.0, 100), (2, 2.0, 64), (3, 4.0, 80)]
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    got = peers.read_miniverl_run(tmp_path, peers.Shape(2, 2, 32))
    assert got["step_seconds"] == [9.0, 2.0, 4.0] and got["generate_seconds"] == [2.25, 0.5, 1.0]
    assert got["trained_tokens_per_step"] == 72  # median of the timed steps' tokens (the warm-up step left out)
    del rows[2]["time/generate"]  # a step without it: the cell's generation is not reported rather than misaligned
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert peers.read_miniverl_run(tmp_path, peers.Shape(2, 2, 32))["generate_seconds"] is None


def test_every_peer_cell_that_cannot_run_is_a_failed_cell_with_its_reason(student_dir, teacher_dir, tmp_path):
    cells = "trl-distill-vllm,trl-topk,unsloth-grpo,miniverl-gkd-16g"
    if importlib.util.find_spec("trl") is None:
        cells += ",trl-distill-hf"  # here it fails on the missing module; with TRL installed it would train
    out = tmp_path / "out"
    argv = args(student_dir, teacher_dir, out, "--cpu", "--shapes", "2x1x4", "--steps", "2", "--cells", cells)
    assert peers.main(argv) == 0
    results = {r["cell"]: r for r in json.loads((out / "peers.json").read_text())}
    assert set(results) == set(cells.split(","))
    assert all(r["status"] == "failed" for r in results.values())
    assert "vLLM generation needs CUDA" in results["trl-distill-vllm"]["reason"]
    assert "vLLM generation needs CUDA" in results["unsloth-grpo"]["reason"]
    assert "not offered synchronously" in results["trl-topk"]["reason"]
    assert "16 GB caps need CUDA" in results["miniverl-gkd-16g"]["reason"]
    if "trl-distill-hf" in results:
        assert results["trl-distill-hf"]["reason"].startswith("not importable here: trl")
    md = (out / "peers.md").read_text()
    assert "Command: `python -m miniverl.bench.peers" in md
    for name in results:
        assert f"| 2x1x4 | {name} |" in md and (out / "2x1x4" / f"{name}.result.json").is_file()


@pytest.mark.slow
def test_a_miniverl_cell_runs_on_the_cpu(student_dir, teacher_dir, tmp_path):
    out = tmp_path / "out"
    argv = args(student_dir, teacher_dir, out, "--cpu", "--shapes", "2x2x4", "--steps", "2")
    assert peers.main([*argv, "--cells", "miniverl-gkd-free", "--cell-timeout", "300"]) == 0
    (r,) = json.loads((out / "peers.json").read_text())
    assert r["status"] == "ok", r["reason"] + "\n" + "\n".join(r["log_tail"])
    assert len(r["step_seconds"]) == 2 and r["median_step_s"] > 0
    assert 0 < r["trained_tokens_per_step"] <= 2 * 2 * 4 and r["trained_tokens_per_s"] > 0


def test_a_cell_scripts_timer_times_each_step_and_its_tokens_skip_the_first_steps_lengths():
    """miniverl/bench/peer_cell.py, shared by scripts/peers/*.py: the callback a peer's trainer calls."""
    from miniverl.bench.peer_cell import step_timer, trained_tokens_per_step

    timer, seconds, lengths = step_timer(cuda=False)
    for length in (500.0, 200.0, 300.0, 100.0):
        timer.on_step_begin()
        timer.on_step_end()
        timer.on_log(None, None, None, logs={"completions/mean_length": length, "loss": 1.0})
    timer.on_log(None, None, None, logs={"loss": 1.0})  # a log without lengths adds none
    assert len(seconds) == 4 and all(s >= 0 for s in seconds) and lengths == [500.0, 200.0, 300.0, 100.0]
    assert trained_tokens_per_step(16, lengths, 512) == 16 * 200.0  # median of the steps after the first
    assert trained_tokens_per_step(16, [480.0], 512) == 16 * 480.0  # one step: its own
    assert trained_tokens_per_step(16, [], 512) == 16 * 512  # nothing logged: every row at full length
    # an even count: the mean of the middle two (peers run 3's TRL lengths; the upper one overstated it by 0.3%)
    assert trained_tokens_per_step(256, [510.6, 512.0, 509.3, 507.1, 512.0], 512) == pytest.approx(256 * 510.65)


def test_a_cell_scripts_generation_is_timed_inside_each_step_and_a_trainer_without_it_says_so():
    from miniverl.bench.peer_cell import GENERATE_METHOD, step_timer, time_generation

    class Trainer:
        calls = 0

        def _generate_single_turn(self, prompt_ids, *rest):
            Trainer.calls += 1
            time.sleep(0.02)
            return ["done"] * len(prompt_ids)

    assert GENERATE_METHOD == "_generate_single_turn"
    timer, seconds, _ = step_timer(cuda=False)
    trainer = Trainer()
    generation = time_generation(trainer, timer, cuda=False)
    for calls in (1, 2, 0):  # a step that generates twice counts both; one that does not, zero
        timer.on_step_begin()
        for _ in range(calls):
            assert trainer._generate_single_turn([1, 2], None) == ["done", "done"]  # what the trainer gets back
        timer.on_step_end()
    assert Trainer.calls == 3 and len(generation) == len(seconds) == 3
    assert 0.02 <= generation[0] <= seconds[0] and 0.04 <= generation[1] <= seconds[1] and generation[2] == 0.0
    plain, _, _ = step_timer(cuda=False)
    assert time_generation(object(), plain, cuda=False) is None  # nothing to wrap: not timed, not zero
    plain.on_step_begin()
    plain.on_step_end()
    assert plain.generation is None


def test_a_splitting_peers_micro_batches_start_at_all_rows_and_halve_in_whole_groups():
    assert peers.micro_batches(256, 1) == [256, 128, 64, 32]  # TRL at 64 x 4: MAX_HALVINGS halvings
    assert peers.micro_batches(512, 1) == [256, 128, 64, 32]  # more rows than FIRST_MICRO_ROWS: that many first
    assert peers.micro_batches(16, 1) == [16, 8, 4, 2]  # fewer rows: all of them first
    assert peers.micro_batches(256, 4) == [256, 128, 64, 32]  # Unsloth's groups of 4
    assert peers.micro_batches(16, 2) == [16, 8, 4, 2]
    assert peers.micro_batches(12, 4) == [12]  # 6 rows would split a group: no halving
    assert peers.micro_batches(8, 8) == [8]
    # rows that 256 does not divide: the most rows up to 256 that the peer's script accepts
    assert peers.micro_batches(320, 1) == [160, 80, 40, 20]
    assert peers.micro_batches(384, 4) == [192, 96, 48, 24]
    assert peers.micro_batches(300, 3) == [150, 75]


def test_a_peer_out_of_memory_is_tried_again_at_half_the_micro_batch(student_dir, teacher_dir, tmp_path, monkeypatch):
    """The cell keeps the try that fit, and says which micro-batches ran out of memory; a peer that runs out at
    every size is a failed cell naming them all."""
    fits_at = {"trl-distill-hf": 64, "unsloth-grpo": 0}  # unsloth: out of memory at every size
    tries = []

    def fake_child(plan, command, env, folder, name):
        micro = int(command[command.index("--micro-batch") + 1])
        tries.append((name, micro))
        if micro > fits_at[name]:
            return 1, ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9 GiB"], 80_000.0
        out = Path(command[command.index("--out") + 1])
        generation = [6.0, 1.5, 1.0] if name == "trl-distill-hf" else [0.0, 0.0, 0.0]  # zeros: never generated
        result = {"step_seconds": [9.0, 2.0, 2.0], "generate_seconds": generation, "trained_tokens_per_step": 4096}
        out.write_text(json.dumps(result))
        return 0, ["done"], 30_000.0

    monkeypatch.setattr(peers, "_run_child", fake_child)
    monkeypatch.setattr(peers, "preflight", lambda cell, env: {"missing": [], "versions": {}})
    plan = peers.parse_args(args(student_dir, teacher_dir, tmp_path, "--cpu", "--shapes", "64x4x512"))
    plan = peers.Plan(**{**plan.__dict__, "cpu": False})  # the GPU's cells, with the children faked
    shape = peers.parse_shape("64x4x512")
    ok = peers.run_cell(plan, peers.CELLS["trl-distill-hf"], shape, log=lambda s: None)
    assert [m for n, m in tries if n == "trl-distill-hf"] == [256, 128, 64]
    assert ok.status == "ok" and ok.command[-2:] == ["--micro-batch", "64"] and ok.smi_peak_mib == 30_000.0
    assert [t.split(":")[0] for t in ok.settings["micro-batches out of memory"]] == ["256 rows", "128 rows"]
    assert ok.median_generate_s == 1.25 and "| 2.00 | 1.25 | 2,048 |" in peers.table([ok])  # steps 2-3's median
    failed = peers.run_cell(plan, peers.CELLS["unsloth-grpo"], shape, log=lambda s: None)
    assert [m for n, m in tries if n == "unsloth-grpo"] == [256, 128, 64, 32]
    assert failed.status == "failed" and failed.reason.startswith("out of memory")
    assert len(failed.settings["micro-batches out of memory"]) == 3  # and the last try's reason is the cell's
    fits_at["unsloth-grpo"] = 256  # fits, but its generation was never timed (all zeros): reported as not timed
    untimed = peers.run_cell(plan, peers.CELLS["unsloth-grpo"], shape, log=lambda s: None)
    assert (
        untimed.status == "ok"
        and untimed.median_generate_s is None
        and "| 2.00 | - | 2,048 |" in peers.table([untimed])
    )


@pytest.mark.parametrize(
    "log_line",
    [
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
        "RuntimeError: engine core failed: out of memory while starting",  # an engine's start, not the update
        "KeyError: 'completions/mean_length'",
    ],
)
def test_a_failure_a_smaller_micro_batch_cannot_cure_is_not_tried_again(
    student_dir, teacher_dir, tmp_path, monkeypatch, log_line
):
    tries = []

    def fake_child(plan, command, env, folder, name):
        tries.append(int(command[command.index("--micro-batch") + 1]))
        return 1, [log_line], 1_000.0

    monkeypatch.setattr(peers, "_run_child", fake_child)
    monkeypatch.setattr(peers, "preflight", lambda cell, env: {"missing": [], "versions": {}})
    plan = peers.parse_args(args(student_dir, teacher_dir, tmp_path, "--cpu"))
    plan = peers.Plan(**{**plan.__dict__, "cpu": False})
    r = peers.run_cell(plan, peers.CELLS["trl-distill-vllm"], peers.parse_shape("64x4x512"), log=lambda s: None)
    assert tries == [256] and r.status == "failed" and "micro-batches out of memory" not in r.settings


def test_miniverls_full_vocabulary_cell_runs_trls_loss_where_the_steps_support_fits_the_host(
    student_dir, teacher_dir, tmp_path
):
    big = tmp_path / "qwen-vocab"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"vocab_size": 151_936}))
    plan = peers.parse_args(args(student_dir, teacher_dir, tmp_path / "out", "--cpu"))
    cell = peers.CELLS["miniverl-gkd-full-16g"]
    small = cell.command(plan, peers.parse_shape("2x2x4"), tmp_path / "c.json")
    assert "objective.teacher_topk=0" in small and "resources.emulate_gpu_gib=16" in small
    budget = float(next(a for a in small if a.startswith("trainer.vocab_memory_budget_gib=")).split("=")[1])
    assert budget == 4  # a tiny support: never below trainer.vocab_memory_budget_gib's default
    qwen_small = peers.Plan(**{**plan.__dict__, "teacher": big})
    qwen16 = cell.command(qwen_small, peers.parse_shape("16x1x512"), tmp_path / "c.json")
    assert "trainer.vocab_memory_budget_gib=6" in qwen16  # 4.64 GiB of support, and room beside it
    qwen = peers.Plan(**{**plan.__dict__, "teacher": big, "cpu": False})
    assert peers.full_support_gib(qwen, peers.parse_shape("16x1x512"))[0] == pytest.approx(4.64, abs=0.01)
    refused = peers.run_cell(qwen, cell, peers.parse_shape("64x4x512"), log=lambda s: None)
    assert refused.status == "failed" and "74 GiB of host memory" in refused.reason
    assert "objective.teacher_topk" in refused.reason  # what miniVERL does instead
