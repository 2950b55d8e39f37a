"""The end-to-end report's arithmetic: slope, medians after warm-up, peak, and the conformance gate."""

from __future__ import annotations

import json

import pytest

from lab.bench.e2e_report import main, memory_slope, plan_check, plan_table, read_cell, summarize, table


def step(k: int, mem: float, gap: float = 0.1, clipped: float = 0.0, t: float = 1.0) -> dict:
    phases = {"time/refresh": 0.1 * t, "time/generate": 0.5 * t, "time/score": 0.1 * t, "time/update": 0.3 * t}
    return {"step": k, "time/step": t, **phases, "gpu/device_used_gib": mem, "sampler_gap_mean": gap,
            "clipped_ratio_frac": clipped}  # fmt: skip


def test_memory_slope_by_hand():
    assert memory_slope([1, 2, 3], [5.0, 5.5, 6.0]) == pytest.approx(0.5)
    assert memory_slope([1, 2, 3, 4], [7.0, 7.0, 7.0, 7.0]) == 0.0
    assert memory_slope([3], [1.0]) == 0.0


def test_summary_skips_warmup_and_eval_rows_and_passes_a_flat_close_run():
    rows = [{"step": 0, "eval/accuracy": 0.1}, step(1, 9.0, t=30.0), step(2, 8.0, t=20.0)]
    rows += [step(k, 8.2) for k in range(3, 53)]
    s = summarize(rows, [7000.0, 9216.0, 8000.0])
    assert s["steps"] == 52 and s["step_s"] == 1.0 and s["generate_s"] == 0.5
    assert s["memory_slope_gib_per_step"] == pytest.approx(0.0) and s["memory_flat"]
    assert s["smi_peak_gib"] == 9.0 and s["gate_passed"]


def test_a_leak_and_a_wrong_base_are_reported():
    rows = [step(k, 8.0 + 0.02 * k, gap=1.66, clipped=0.4) for k in range(1, 53)]
    s = summarize(rows, [])
    assert s["memory_slope_gib_per_step"] == pytest.approx(0.02) and not s["memory_flat"]
    assert s["sampler_gap_mean"] == pytest.approx(1.66) and s["gate_passed"] is False


def test_an_allocator_step_then_a_plateau_is_told_from_a_leak_by_the_late_slope():
    """MOPD run 2's one-teacher cell: 12.05 GiB to step 16, 12.44 from 17 to 52; the preregistered verdict (the whole
    run's slope) stays as it is, and the second half's slope says the growth stopped; a leak keeps rising there."""
    plateau = summarize([step(k, 12.05 if k < 17 else 12.44) for k in range(1, 53)], [])
    assert plateau["memory_slope_gib_per_step"] > 0.005 and not plateau["memory_flat"]
    assert plateau["memory_late_slope_gib_per_step"] == pytest.approx(0.0)
    leak = summarize([step(k, 8.0 + 0.02 * k) for k in range(1, 53)], [])
    assert leak["memory_late_slope_gib_per_step"] == pytest.approx(0.02)


def test_a_cell_that_never_ran_is_reported_not_dropped(tmp_path):
    (tmp_path / "ok_metrics.jsonl").write_text("\n".join(json.dumps(step(k, 8.0)) for k in range(1, 6)))
    (tmp_path / "ok_smi.csv").write_text("8000\n8100\n")
    cells = [read_cell(tmp_path, "ok"), read_cell(tmp_path, "missing")]
    assert cells[1] == {"cell": "missing", "steps": 0, "smi_peak_gib": 0.0}
    text = table(cells)
    assert "| ok | 5 | 1 |" in text and "| missing | 0 | - |" in text


def test_a_folder_that_is_not_there_is_refused_and_nothing_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "no-such-run")])
    assert stop.value.code == 2 and "is not a folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_report_writes_its_json_beside_the_cells(tmp_path, capsys):
    (tmp_path / "ok_metrics.jsonl").write_text("\n".join(json.dumps(step(k, 8.0)) for k in range(1, 6)))
    main([str(tmp_path)])
    assert json.loads((tmp_path / "e2e_report.json").read_text())[0]["steps"] == 5
    assert "| ok | 5 |" in capsys.readouterr().out


def test_each_gpu_process_peak_is_named_by_the_actor_the_log_gives_its_pid(tmp_path):
    """A whole-device peak over the plan (the 7B recipe: 15.1 GiB against 13.9) is put on the actor that made it."""
    (tmp_path / "c_metrics.jsonl").write_text(json.dumps(step(1, 9.0)) + "\n")
    (tmp_path / "c.log").write_text(
        "(RolloutWorker pid=1138) INFO engine\n(ScorerWorker pid=4504) scorer: forwards of up to 2302 tokens\n"
        "(LearnerWorker pid=4502) learner: micro-batches\n"
    )
    (tmp_path / "c_apps.csv").write_text(
        "1138, 3900\n4504, 6100\n1138, 4100\n4502, 2900\n777, 500\n4502, [N/A]\nNo running processes found\n"
    )
    cell = read_cell(tmp_path, "c")
    assert cell["smi_process_peak_mib"] == {
        "RolloutWorker": 4100.0,
        "ScorerWorker": 6100.0,
        "LearnerWorker": 2900.0,
        "pid 777": 500.0,  # not an actor the log names (the driver, or a process of vLLM's own)
    }
    # the cell's plan check gets them: its engine rollout is set against its actor's process and the unnamed ones
    plan = recorded_plan("engine")
    (tmp_path / "c_summary.json").write_text(json.dumps({"plan": plan, "memory": {}}))
    assert read_cell(tmp_path, "c")["plan_check"]["rollout"]["measured_gib"] == pytest.approx(4600 / 1024)
    (tmp_path / "c_apps.csv").write_text("1138, 4100\n4504, 6100\n")
    assert read_cell(tmp_path, "c")["plan_check"]["rollout"]["measured_gib"] == pytest.approx(4100 / 1024)
    (tmp_path / "c_apps.csv").write_text("4504, 6100\n777, 500\n")  # the log names no process of the rollout's
    assert read_cell(tmp_path, "c")["plan_check"]["rollout"]["measured_gib"] is None
    (tmp_path / "c_apps.csv").unlink()
    assert "smi_process_peak_mib" not in read_cell(tmp_path, "c")  # older runs: no per-process samples


def recorded_plan(rollout_as: str = "reserved") -> dict:
    """summary.json's "plan" (setup/fit.py FitPlan.record) of a 16 GiB card."""
    actor = lambda peak, measured_as: {"peak_gib": peak, "reserved_gib": peak * 1.2, "measured_as": measured_as}  # noqa: E731
    return {
        "card_gib": 16.0,
        "device_peak_gib": 13.6,
        "actors": {
            "learner": actor(2.2, "allocated"),
            "scorer": actor(5.0, "allocated"),
            "rollout": actor(4.5, rollout_as),
        },
    }


def test_the_plan_is_checked_against_the_peak_each_model_stands_for():
    """Session 38's MOPD cells: the learner and scorer models are of torch's allocated peak, the HF rollout's of its
    reserved one (the cap limits reserved memory), the card's of nvidia-smi's; error = modelled / measured - 1."""
    memory = {
        "learner": {"peak_allocated_gib": 2.0, "peak_reserved_gib": 2.5},
        "scorer": {"peak_allocated_gib": 5.0, "peak_reserved_gib": 5.2},
        "rollout": {"peak_allocated_gib": 3.0, "peak_reserved_gib": 3.6},
    }
    check = plan_check(recorded_plan(), memory, 13.6 / 1.25)
    assert check["learner"]["measured_gib"] == 2.0 and check["learner"]["error_pct"] == pytest.approx(10.0)
    assert check["scorer"]["error_pct"] == pytest.approx(0.0)
    assert check["rollout"]["measured_gib"] == 3.6 and check["rollout"]["error_pct"] == pytest.approx(25.0)
    assert check["card"]["error_pct"] == pytest.approx(25.0)
    # a vLLM engine's memory is in its own process, which the actor's torch numbers do not see: not checked here
    engine = plan_check(recorded_plan("engine"), memory, 0.0)
    assert engine["rollout"]["measured_gib"] is None and engine["rollout"]["error_pct"] is None
    assert engine["card"]["error_pct"] is None  # no nvidia-smi samples
    assert plan_check(recorded_plan(), {}, 12.0)["learner"]["error_pct"] is None  # a run that never reported memory
    # the allocators' reserve the card counts, against the reserved peaks (learner 2.64 against 2.5, scorer 6.0 / 5.2)
    assert check["learner"]["reserved_modelled_gib"] == pytest.approx(2.64)
    assert check["learner"]["reserved_error_pct"] == pytest.approx(5.6)
    assert check["scorer"]["reserved_error_pct"] == pytest.approx(100 * (6.0 / 5.2 - 1))
    assert "reserved_error_pct" not in check["rollout"]  # planned at reserved already


def test_an_engine_rollout_is_checked_against_its_processes_in_nvidia_smi():
    """Session 39's 7B cell: vLLM's process held 0.63 GiB outside torch beside its context (nvidia-smi 4,938 MiB,
    torch reserved 3.53 GiB), which only the per-process samples show: the engine's share, what the plan puts
    outside torch and one CUDA context are set against them. SGLang's scheduler (run 3: 7,928 MiB beside its actor's
    518) is a process the log names no actor for: it is the engine's, added to its actor's."""
    plan = recorded_plan("engine")
    plan["actors"]["rollout"]["outside_gib"] = 0.6
    plan.update(contexts=3, contexts_gib=1.98)
    memory = {"learner": {"peak_allocated_gib": 2.0, "peak_reserved_gib": 2.5}}
    named = {"RolloutWorker": 4938.0, "ScorerWorker": 6832.0, "LearnerWorker": 3950.0}
    rollout = plan_check(plan, memory, 15.0, named)["rollout"]
    assert rollout["measured_as"] == "engine"
    assert rollout["modelled_gib"] == pytest.approx(4.5 + 0.6 + 0.66)
    assert rollout["measured_gib"] == pytest.approx(4938 / 1024)
    assert rollout["error_pct"] == pytest.approx(100 * (5.76 / (4938 / 1024) - 1))
    # a GPU process the log does not name is the engine's own child (SGLang's scheduler): added to its actor's
    child = plan_check(plan, memory, 15.0, {**named, "RolloutWorker": 518.0, "pid 3678": 7928.0})["rollout"]
    assert child["measured_gib"] == pytest.approx((518 + 7928) / 1024)
    assert plan_check(plan, memory, 15.0, {"ScorerWorker": 6832.0})["rollout"]["error_pct"] is None  # none named
    # run 4's vLLM cell, cut short: its log named only the rollout's actor, so the scorer's and learner's processes
    # were unnamed; they are not the engine's, and the rollout is not checked (it read 14.78 GiB, the whole card)
    unnamed = {"RolloutWorker": 5900.0, "pid 6858": 4756.0, "pid 6865": 4480.0}
    assert plan_check(plan, memory, 15.0, unnamed)["rollout"]["measured_gib"] is None
    # a plan recorded before outside_gib existed counts nothing outside torch
    del plan["actors"]["rollout"]["outside_gib"]
    assert plan_check(plan, memory, 15.0, named)["rollout"]["modelled_gib"] == pytest.approx(4.5 + 0.66)


def test_replicas_are_checked_at_their_largest_peak_and_a_colocated_process_as_its_roles_together():
    """resources.gpus=2 names processes learner0, learner1, ...; resources.colocate=true one `colocated` process whose
    peaks are its roles' together (cluster/colocate.py processes)."""
    replicas = {
        "learner0": {"peak_allocated_gib": 2.0, "peak_reserved_gib": 2.5},
        "learner1": {"peak_allocated_gib": 2.2, "peak_reserved_gib": 2.4},
        "scorer": {"peak_allocated_gib": 5.0, "peak_reserved_gib": 5.2},
    }
    check = plan_check(recorded_plan(), replicas, 0.0)
    assert check["learner"]["measured_gib"] == 2.2 and check["learner"]["reserved_measured_gib"] == 2.5
    assert check["scorer"]["measured_gib"] == 5.0 and "colocated" not in check
    colocated = plan_check(recorded_plan(), {"colocated": {"peak_allocated_gib": 11.0, "peak_reserved_gib": 12.0}}, 0.0)
    assert colocated["learner"]["measured_gib"] is None  # no process of the learner's own
    # learner 2.2 x 1.2 + scorer 5.0 x 1.2 (their reserve) + the rollout's 4.5 x 1.2 here, against 12.0
    assert colocated["colocated"]["modelled_gib"] == pytest.approx(14.04)
    assert colocated["colocated"]["error_pct"] == pytest.approx(17.0)


def test_a_cell_that_recorded_its_plan_gets_the_plan_table_and_older_cells_do_not(tmp_path, capsys):
    memory = {r: {"peak_allocated_gib": 2.0, "peak_reserved_gib": 4.0} for r in ("learner", "scorer", "rollout")}
    for cell, summary in (("new", {"plan": recorded_plan(), "memory": memory}), ("old", {"memory": memory})):
        (tmp_path / f"{cell}_metrics.jsonl").write_text("\n".join(json.dumps(step(k, 8.0)) for k in range(1, 6)))
        (tmp_path / f"{cell}_summary.json").write_text(json.dumps(summary))
    (tmp_path / "new_smi.csv").write_text("13926.4\n")  # 13.6 GiB
    new, old = read_cell(tmp_path, "new"), read_cell(tmp_path, "old")
    assert "plan_check" not in old and new["plan_check"]["card"]["error_pct"] == pytest.approx(0.0)
    text = plan_table([new, old])
    assert (
        "| new | 2.20 / 2.00 (+10.0%) | 5.00 / 2.00 (+150.0%) | 4.50 / 4.00 (+12.5%) | 13.60 / 13.60 (+0.0%) |" in text
    )
    assert "| old |" not in text and plan_table([old]) == ""
    main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "The plan against the measured peaks" in out and "| new | 2.20 / 2.00 (+10.0%)" in out


def test_a_cell_cut_short_is_read_from_the_run_directory_the_queue_packed(tmp_path, capsys):
    """Session 40: the device's time ran out at step 38 of 50; the cell's script never copied its metrics or summary
    into res/, the queue's collect had packed runs/<cell>/metrics.jsonl (and plan.json, written before Ray) beside
    it. The report reads them there, marks the cell, and checks the plan against nvidia-smi; a run directory whose
    cell the script did not start here (no <cell>.log) is not a cell of this report."""
    res, runs = tmp_path / "res", tmp_path / "runs"
    (runs / "cut").mkdir(parents=True)
    (runs / "other").mkdir()
    res.mkdir()
    (res / "done_metrics.jsonl").write_text("\n".join(json.dumps(step(k, 8.0)) for k in range(1, 6)))
    (runs / "cut" / "metrics.jsonl").write_text("\n".join(json.dumps(step(k, 8.0)) for k in range(1, 39)))
    (runs / "other" / "metrics.jsonl").write_text(json.dumps(step(1, 8.0)))
    (res / "cut.log").write_text("(RolloutWorker pid=1138) INFO engine\n")
    (res / "cut_smi.csv").write_text("14000\n15062\n")
    (runs / "cut" / "plan.json").write_text(json.dumps(recorded_plan()))
    main([str(res)])
    out = capsys.readouterr().out
    cells = {c["cell"]: c for c in json.loads((res / "e2e_report.json").read_text())}
    assert sorted(cells) == ["cut", "done"]
    assert cells["cut"]["steps"] == 38 and cells["cut"]["cut_short"] and "cut_short" not in cells["done"]
    check = cells["cut"]["plan_check"]
    assert check["card"]["error_pct"] == pytest.approx(100 * (13.6 / (15062 / 1024) - 1))
    assert check["learner"]["measured_gib"] is None  # the torch peaks were in the summary it never wrote
    assert "| cut (cut short) | 38 |" in out and "| cut (cut short) | 2.20 / - (allocated)" in out
    # what the cell's script copied wins over the run directory's (the same run, copied when it ended)
    (runs / "done").mkdir()
    (runs / "done" / "metrics.jsonl").write_text(json.dumps(step(1, 8.0)))
    (res / "done.log").write_text("")
    assert read_cell(res, "done")["steps"] == 5 and "cut_short" not in read_cell(res, "done")


def test_the_machine_under_a_cell_is_reported_beside_its_step_time_drift(tmp_path, capsys):
    """Session 41: the 7B recipe's step drifted from 10.9 to 14.7 s with the memory flat and the scorer steady, and
    nothing recorded could say whether the machine did it. <cell>_host.csv (the GPU's clock, the host's load every 5
    s) is read into the clock's and the load's thirds beside the step's; a line the driver could not fill is skipped,
    and a cell without the file gets no machine table."""
    steps = [step(k, 8.0, t=10.0 if k <= 10 else 14.0) for k in range(1, 17)]  # 2 warm-up steps, then 14 timed
    (tmp_path / "drift_metrics.jsonl").write_text("\n".join(json.dumps(s) for s in steps))
    host = ["unix_s,sm_mhz,gpu_util_pct,power_w,temp_c,load1,cpus"]  # a header is not a sample
    host += ["500,345,0,70.0,30,40.0,16"]  # the engines' start, long before the steps (184 s of them): left out
    host += [f"{1000 + 5 * i},1980,80,400.5,50,{2.0 if i < 6 else 15.0},16" for i in range(9)]
    host.insert(4, "1015,[N/A],80,400.5,50,2.0,16")
    (tmp_path / "drift_host.csv").write_text("\n".join(host) + "\n")
    (tmp_path / "plain_metrics.jsonl").write_text("\n".join(json.dumps(step(k, 8.0)) for k in range(1, 6)))
    main([str(tmp_path)])
    out = capsys.readouterr().out
    cells = {c["cell"]: c for c in json.loads((tmp_path / "e2e_report.json").read_text())}
    m = cells["drift"]["machine"]
    assert m["samples"] == 9 and m["cpus"] == 16 and m["sm_mhz_min"] == 1980
    assert m["step_s_thirds"] == [10.0, 14.0] and m["load1_thirds"] == [2.0, 15.0] and m["load1_max"] == 15.0
    assert "machine" not in cells["plain"]
    assert (
        "| drift | 9 | 10.0 / 14.0 | 1980 (1980) | 1980 / 1980 | 80 | 400 | 50 | 2.0 (15.0) | 2.0 / 15.0 | 16 |" in out
    )
    assert "| plain |" not in out.split("The machine under each cell")[1]
    # a warm-up step that compiles for 60 s with the GPU idle (run 3's 12-step hf_cached cell) is left out too
    compiled = [step(1, 8.0, t=60.0), step(2, 8.0, t=4.0)] + [step(k, 8.0, t=4.0) for k in range(3, 13)]
    (tmp_path / "compiled_metrics.jsonl").write_text("\n".join(json.dumps(s) for s in compiled))
    idle = [f"{2000 + 5 * i},1980,0,120.0,37,2.0,16" for i in range(12)]  # the first step's compile
    busy = [f"{2060 + 5 * i},1980,99,500.0,55,2.0,16" for i in range(14)]  # 40 s of steps, then 25 s of the end
    (tmp_path / "compiled_host.csv").write_text("\n".join(idle + busy) + "\n")
    main([str(tmp_path)])
    capsys.readouterr()
    cells = {c["cell"]: c for c in json.loads((tmp_path / "e2e_report.json").read_text())}
    assert cells["compiled"]["machine"]["gpu_util_pct_median"] == 99 and cells["compiled"]["machine"]["samples"] == 13
    # no host file anywhere: no machine table at all
    (tmp_path / "drift_host.csv").unlink()
    (tmp_path / "compiled_host.csv").unlink()
    main([str(tmp_path)])
    assert "The machine under each cell" not in capsys.readouterr().out
