"""lab.bench.peers (issue 34's peers harness): import-safe, refuses bad arguments before anything runs, and
records a peer that is missing or cannot run here as a failed cell with its reason instead of crashing."""

from __future__ import annotations

import importlib.util
import json
import runpy
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from lab.bench import peer_prompts, peers
from lab.bench.peer_prompts import step_examples, step_prompts
from miniverl.data.prompts import held_out_prompts

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("trl", "unsloth", "vllm", "datasets")


def test_importing_the_harness_and_its_cell_scripts_imports_no_peer():
    code = (
        "import runpy, sys; import lab.bench.peers, lab.bench.peer_prompts\n"
        "for s in ('trl_distill', 'unsloth_grpo'): runpy.run_path(f'lab/peers/{s}.py', run_name='x')\n"
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
        (["--miniverl-overrides", "trainer.compile_layers"], "write key=value, e.g. trainer.compile_layers=false"),
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
    held_out = held_out_prompts(
        peer_prompts.TASK, peer_prompts.TASK_MIN_LEN, peer_prompts.TASK_MAX_LEN, peer_prompts.DATA_SEED, 8
    )
    assert not {p for p, _ in examples} & held_out
    assert step_prompts(4, 1, 2) == [p for p, _ in examples[:4] for _ in range(2)]
    assert step_examples(4, 1) == examples[:4]  # a step's prompts do not depend on how many steps are drawn


def test_miniverl_run_is_read_from_its_metrics(tmp_path):
    rows = [{"step": 0, "accuracy": 0.1}] + [
        {"step": s, "time/step": t, "time/generate": t / 4, "time/update/gradients": t / 2, "response_tokens": n}
        for s, t, n in [(1, 9.0, 100), (2, 2.0, 64), (3, 4.0, 80)]
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    got = peers.read_miniverl_run(tmp_path, peers.Shape(2, 2, 32))
    assert got["step_seconds"] == [9.0, 2.0, 4.0] and got["generate_seconds"] == [2.25, 0.5, 1.0]
    assert got["trained_tokens_per_step"] == 72  # median of the timed steps' tokens (the warm-up step left out)
    # each phase's median over the timed steps, the update's split included
    assert got["settings"]["phase medians (s)"] == {"time/generate": 0.75, "time/update/gradients": 1.5}
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
    assert "Command: `python -m lab.bench.peers" in md
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
    """lab/bench/peer_cell.py, shared by lab/peers/*.py: the callback a peer's trainer calls."""
    from lab.bench.peer_cell import step_timer, trained_tokens_per_step

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
    from lab.bench.peer_cell import GENERATE_METHOD, step_timer, time_generation

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


# --prompt-len and --stop-median: realistic shapes, the same in every cell; the defaults change no cell.
PROMPT_OPTIONS = ("--prompt-len", "--stop-ids", "data.min_len", "data.max_len", "data.max_prompt_length")


def scripts() -> dict[str, dict]:
    """The peers' cell scripts' functions (their imports are light: see the first test)."""
    return {s: runpy.run_path(str(ROOT / "lab" / "peers" / f"{s}.py"), run_name="x") for s in SCRIPTS}


SCRIPTS = ("trl_distill", "unsloth_grpo")
SCRIPT_OF = {"trl-distill-vllm": "trl_distill", "trl-distill-hf": "trl_distill", "unsloth-grpo": "unsloth_grpo"}


def gpu_plan(plan: peers.Plan) -> peers.Plan:
    return peers.Plan(**{**plan.__dict__, "cpu": False})  # the GPU's commands (gkd_4080, --vllm), built on the CPU


def test_the_harness_default_bounds_are_miniverls_data_defaults():
    """At the default bounds miniVERL gets no data.min_len/max_len, so the peers' stream is its stream only if these
    are its defaults."""
    from miniverl.config.data import DataConfig

    data = DataConfig()
    assert (data.min_len, data.max_len) == peer_prompts.DEFAULT_PROMPT_LEN
    assert (data.task, data.seed) == (peer_prompts.TASK, peer_prompts.DATA_SEED)


def test_the_default_options_leave_every_cells_command_line_as_it_was(student_dir, teacher_dir, tmp_path):
    plan = peers.parse_args(args(student_dir, teacher_dir, tmp_path, "--cpu", "--shapes", "2x2x8"))
    assert (plan.prompt_len, plan.prompt_tokens, plan.stop_median, plan.stop_ids) == ((3, 8), 0, 0, ())
    shape, out = plan.shapes[0], tmp_path / "c.json"
    hf = peers.CELLS["trl-distill-hf"].command(plan, shape, out)
    assert hf == [
        sys.executable,
        str(ROOT / "lab" / "peers" / "trl_distill.py"),
        *("--student", str(student_dir), "--teacher", str(teacher_dir), "--out", str(out)),
        *("--prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--steps", "5", "--beta", "0.5", "--cpu"),
    ]
    for name, cell in peers.CELLS.items():
        if name == "trl-topk":
            continue
        command = cell.command(gpu_plan(plan), shape, out)
        assert not [a for a in command if a.startswith(PROMPT_OPTIONS) or "stop" in a], name
    found = scripts()
    for name, script in SCRIPT_OF.items():
        got = found[script]["parse_args"](peers.CELLS[name].command(gpu_plan(plan), shape, out)[2:])
        assert (got.prompt_len, got.stop_ids) == ((3, 8), ()), name
        if script == "trl_distill":
            assert found[script]["generation_kwargs"](got) is None, name  # TRL's default, on both paths
        else:
            assert found[script]["stop_kwargs"](got) == {}  # GRPOConfig keeps Unsloth's default generation_kwargs


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-len", "0:5"], "LO must be >= 1"),
        (["--prompt-len", "9:5"], "LO 9 > HI 5; write the shorter bound first: 5:9"),
        (["--prompt-len", "100-320"], "write LO:HI"),
        (["--prompt-len=-1:5"], "write LO:HI"),  # argparse takes a bare -1:5 for an option
        (["--stop-median", "-1"], "--stop-median=-1: give the median response length in tokens, or 0"),
        # the built-in models hold 64 positions: 60 letters, '>' and BOS, and 8 new tokens do not fit
        (["--prompt-len", "20:60", "--shapes", "2x2x8"], "= 70 pass the student's max_position_embeddings 64"),
    ],
)
def test_bad_prompt_and_stop_options_name_the_fix(student_dir, teacher_dir, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        peers.parse_args(args(student_dir, teacher_dir, tmp_path, "--cpu", *extra))
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [(["--prompt-len", "0:5"], "LO must be >= 1"), (["--stop-ids", "5,x"], "non-negative integers joined by commas")],
)
def test_the_cell_scripts_refuse_bad_prompt_and_stop_options(capsys, extra, message):
    base = ["--student", "s", "--teacher", "t", "--out", "o.json", "--prompts", "2", "--samples", "2"]
    for script in scripts().values():
        with pytest.raises(SystemExit):
            script["parse_args"]([*base, "--max-new-tokens", "8", *extra])
        assert message in capsys.readouterr().err


def test_every_cell_carries_the_bounds_and_the_stop_ids_to_its_script(student_dir, teacher_dir, tmp_path):
    from lab.bench.random_stops import stop_set

    argv = args(student_dir, teacher_dir, tmp_path, "--cpu", "--shapes", "2x2x8", "--prompt-len", "20:40")
    plan = gpu_plan(peers.parse_args([*argv, "--stop-median", "3"]))
    stops = stop_set(3, 43, peers.STOP_SEED)  # the built-in tokenizer's 43 tokens
    assert plan.stop_ids == stops and len(stops) == 10 and plan.prompt_tokens == 42  # 40 letters, '>' and BOS
    shape, out = plan.shapes[0], tmp_path / "c.json"
    found = scripts()
    for name, script in SCRIPT_OF.items():
        got = found[script]["parse_args"](peers.CELLS[name].command(plan, shape, out)[2:])
        assert (got.prompt_len, got.stop_ids) == ((20, 40), stops), name
        if name == "trl-distill-vllm":  # vLLM's SamplingParams; transformers' generate reads the model's EOS list
            assert found[script]["generation_kwargs"](got) == {"stop_token_ids": list(stops)}
        elif name == "trl-distill-hf":
            assert found[script]["generation_kwargs"](got) is None
        else:
            assert found[script]["stop_kwargs"](got) == {"generation_kwargs": {"stop_token_ids": list(stops)}}
    for name in ("miniverl-gkd-16g", "miniverl-pg_k1-free"):
        command = peers.CELLS[name].command(plan, shape, out)
        assert {"data.min_len=20", "data.max_len=40", "data.max_prompt_length=42"} <= set(command), name
        assert f"rollout.stop_token_ids=[{','.join(map(str, stops))}]" in command, name


def test_each_cells_json_records_the_bounds_and_the_stops(student_dir, teacher_dir, tmp_path, monkeypatch):
    def fake_child(plan, command, env, folder, name):
        out = Path(command[command.index("--out") + 1])
        out.write_text(json.dumps({"step_seconds": [2.0, 1.0], "trained_tokens_per_step": 24}))
        return 0, ["done"], None

    monkeypatch.setattr(peers, "_run_child", fake_child)
    monkeypatch.setattr(peers, "preflight", lambda cell, env: {"missing": [], "versions": {}})
    argv = args(student_dir, teacher_dir, tmp_path, "--cpu", "--shapes", "2x2x8", "--prompt-len", "20:40")
    plan = peers.parse_args([*argv, "--stop-median", "3", "--cells", "trl-distill-hf"])
    r = peers.run_cell(plan, peers.CELLS["trl-distill-hf"], plan.shapes[0], log=lambda s: None)
    assert r.status == "ok" and (r.prompt_len, r.stop_median, r.stop_ids) == ([20, 40], 3, 10)
    assert {"prompt_len": [20, 40], "stop_median": 3, "stop_ids": 10}.items() <= asdict(r).items()
    report = peers.report(plan, [r], argv)
    assert "strings of 20-40 characters; rows also stop on 10 ids (stop_set median 3, seed 7)" in report


def qwen_shaped(model: Path, path: Path) -> Path:
    """`model`'s tokenizer and config with the 0.5B shape's vocabulary and positions (the harness's GPU models): what
    composing a cell's config reads; no weights."""
    path.mkdir()
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "generation_config")):
            shutil.copy(f, path / f.name)
    config = json.loads((model / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": 151_936, "max_position_embeddings": 4096}))
    return path


def composed(command: list[str]):
    """The config `python -m miniverl.main` would train under for a miniVERL cell's command, checked as a run checks
    it before loading a model (miniverl.fit's steps)."""
    from hydra import compose, initialize_config_dir

    from miniverl.config import check_values, register_configs, to_config
    from miniverl.main import CONF
    from miniverl.setup.argv import checked_command_line

    assert command[1:3] == ["-m", "miniverl.main"]
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = to_config(compose(config_name="config", overrides=checked_command_line(command[3:], None)))
    check_values(cfg)
    return cfg


@pytest.mark.parametrize("gpu", [False, True])
def test_miniverl_and_the_peers_draw_the_same_prompts_at_realistic_bounds(student_dir, tmp_path, gpu):
    """At 100:320 with stops of median 150: miniVERL's composed run (gkd on the CPU, gkd_4080 on the GPU) draws the
    peers' prompts step for step, holds out the same evaluation prompts, its max_prompt_length holds the longest
    prompt exactly, and its stop ids are the harness's 702 (a list that long parses on Hydra's command line)."""
    from transformers import AutoTokenizer

    from lab.bench.random_stops import stop_set
    from miniverl.data.build import build_prompt_source

    qwen = qwen_shaped(student_dir, tmp_path / "qwen")
    argv = args(qwen, qwen, tmp_path / "out", "--cpu", "--shapes", "4x2x16", "--steps", "3", "--prompt-len", "100:320")
    plan = peers.parse_args([*argv, "--stop-median", "150"])
    plan = gpu_plan(plan) if gpu else plan
    tok = AutoTokenizer.from_pretrained(qwen)
    bounds = (100, 320)
    for name in ("miniverl-gkd-free", "miniverl-pg_k1-16g"):
        shape = plan.shapes[0].grouped() if "pg_k1" in name else plan.shapes[0]
        cfg = composed(peers.CELLS[name].command(plan, plan.shapes[0], tmp_path / "c.json"))
        d = cfg.data
        assert (d.task, d.min_len, d.max_len, d.seed, d.eval_prompts) == (
            "reverse",
            *bounds,
            0,
            peer_prompts.EVAL_PROMPTS,
        )
        assert d.max_prompt_length == len(tok("a" * 320 + ">")["input_ids"]) == 322  # the longest, to the token
        assert cfg.rollout.stop_token_ids == list(stop_set(150, 151_936, 7)) and len(cfg.rollout.stop_token_ids) == 702
        source = build_prompt_source(d, tok, cfg.trainer.total_steps, log=lambda s: None)  # raises on a long prompt
        peer = step_examples(shape.prompts, plan.steps, bounds)
        for step in range(plan.steps):
            rows = peer[step * shape.prompts : (step + 1) * shape.prompts]
            assert source.batch(step, d.prompts_per_step).prompt_ids == [tok(p)["input_ids"] for p, _ in rows]
        assert source.held_out == held_out_prompts(
            peer_prompts.TASK, *bounds, peer_prompts.DATA_SEED, peer_prompts.EVAL_PROMPTS
        )
        assert all(100 <= len(p) - 1 <= 320 for p, _ in peer) and len({len(p) for p, _ in peer}) > 1


def test_a_peers_eos_list_is_miniverls_union_with_the_stop_ids():
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from lab.bench.peer_cell import stop_on
    from miniverl.errors import ConfigError

    def model(eos):
        return SimpleNamespace(
            generation_config=GenerationConfig(eos_token_id=eos), config=SimpleNamespace(vocab_size=43)
        )

    tok = SimpleNamespace(eos_token_id=2)
    instruct = model([7, 2])  # an instruct model's end-of-turn first, the tokenizer's EOS among its ids
    assert stop_on(instruct, tok, (5, 7, 9)) == [2, 7, 5, 9] == instruct.generation_config.eos_token_id
    plain = model(2)
    assert stop_on(plain, tok, (5,)) == [2, 5] == plain.generation_config.eos_token_id
    with pytest.raises(ConfigError, match="outside the student's vocabulary"):
        stop_on(model(2), tok, (43,))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed (CI has none)")
def test_trl_and_miniverl_cells_stop_at_varied_lengths_on_the_cpu(random_model_dir, teacher_dir, tmp_path):
    """A random student (nearly uniform next-token law) at --stop-median 3: rows end at varied lengths in both
    cells, TRL's EOS list holds the stops, and each cell's trained tokens are its rows' real tokens."""
    out = tmp_path / "out"
    argv = args(random_model_dir, teacher_dir, out, "--cpu", "--shapes", "2x2x8", "--steps", "3")
    argv += ["--prompt-len", "20:40", "--stop-median", "3", "--cells", "trl-distill-hf,miniverl-gkd-free"]
    assert peers.main([*argv, "--cell-timeout", "300"]) == 0
    results = {r["cell"]: r for r in json.loads((out / "peers.json").read_text())}
    for r in results.values():
        assert r["status"] == "ok", r["reason"] + "\n" + "\n".join(r["log_tail"])
        assert (r["prompt_len"], r["stop_median"], r["stop_ids"]) == ([20, 40], 3, 10)
    trl = json.loads((out / "2x2x8" / "trl-distill-hf.json").read_text())
    assert trl["settings"]["eos_token_ids"] == 11  # the tokenizer's EOS and the 10 stop ids
    assert any(lo < hi for lo, hi in trl["length_ranges"]) and max(hi for _, hi in trl["length_ranges"]) <= 8
    assert trl["trained_tokens_per_step"] == 4 * statistics.median(trl["mean_lengths"][1:]) < 4 * 8
    assert results["trl-distill-hf"]["trained_tokens_per_step"] == trl["trained_tokens_per_step"]
    metrics = [json.loads(line) for line in (out / "2x2x8" / "miniverl-gkd-free" / "metrics.jsonl").open()]
    tokens = [m["response_tokens"] for m in metrics if "time/step" in m]
    assert len(tokens) == 3 and max(tokens) < 4 * 8  # no step of 4 rows ran every row to 8 tokens
    assert results["miniverl-gkd-free"]["trained_tokens_per_step"] == statistics.median(tokens[1:])


def test_miniverl_overrides_reach_every_miniverl_cell_and_a_key_the_harness_sets_is_refused(
    student_dir, teacher_dir, tmp_path
):
    """--miniverl-overrides: appended to each miniVERL cell's command (the peers' commands unchanged); one that
    sets a key the harness sets for the cell (its steps, shape, caps) makes that cell a failed one with the fix."""
    argv = args(student_dir, teacher_dir, tmp_path, "--cpu", "--shapes", "2x2x8")
    plain = gpu_plan(peers.parse_args(argv))
    plan = gpu_plan(peers.parse_args([*argv, "--miniverl-overrides", "trainer.compile_layers=false +x.y=1"]))
    assert plan.miniverl_overrides == ("trainer.compile_layers=false", "+x.y=1")
    shape, out = plan.shapes[0], tmp_path / "c.json"
    for name in ("miniverl-gkd-16g", "miniverl-pg_k1-free"):
        before = peers.CELLS[name].command(plain, shape, out)
        assert peers.CELLS[name].command(plan, shape, out) == [*before, "trainer.compile_layers=false", "+x.y=1"]
    assert peers.CELLS["trl-distill-vllm"].command(plan, shape, out) == peers.CELLS["trl-distill-vllm"].command(
        plain, shape, out
    )
    clash = gpu_plan(peers.parse_args([*argv, "--miniverl-overrides", "trainer.total_steps=9"]))
    with pytest.raises(peers.NotRunnable, match="trainer.total_steps=9: the harness sets that key for this cell"):
        peers.CELLS["miniverl-gkd-16g"].command(clash, shape, out)


def test_peer_attention_flash_reaches_each_peer_script_and_only_the_peers(student_dir, teacher_dir, tmp_path):
    """--peer-attention flash: TRL's and Unsloth's scripts get --flash-attention (the setting miniVERL's actors run
    with), miniVERL's commands do not change; without it no peer gets it; a value other than default/flash is
    refused."""
    argv = args(student_dir, teacher_dir, tmp_path, "--cpu", "--shapes", "2x2x8")
    plain = gpu_plan(peers.parse_args(argv))
    plan = gpu_plan(peers.parse_args([*argv, "--peer-attention", "flash"]))
    shape, out = plan.shapes[0], tmp_path / "c.json"
    found = scripts()
    for name, script in SCRIPT_OF.items():
        assert not found[script]["parse_args"](peers.CELLS[name].command(plain, shape, out)[2:]).flash_attention
        assert found[script]["parse_args"](peers.CELLS[name].command(plan, shape, out)[2:]).flash_attention, name
    for name in ("miniverl-gkd-16g", "miniverl-pg_k1-free"):
        assert peers.CELLS[name].command(plan, shape, out) == peers.CELLS[name].command(plain, shape, out)
    with pytest.raises(SystemExit):
        peers.parse_args([*argv, "--peer-attention", "cudnn"])


def test_a_peer_scripts_flash_attention_turns_cudnn_off_and_says_so():
    """apply_attention: with --flash-attention torch's SDPA may not pick cuDNN in the script's process, and the
    setting it returns is what the cell's JSON records; without it torch's choice is left alone."""
    import argparse

    import torch

    from lab.bench.peer_cell import apply_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert apply_attention(argparse.Namespace(flash_attention=False)).startswith("torch's default")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert apply_attention(argparse.Namespace(flash_attention=True)).startswith("flash")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
