"""The log-prob conformance gate: its numbers, its decision (pass, refuse, pass with TIS) and its message."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.batches import PromptBatch
from miniverl.errors import ConfigError
from miniverl.models.lora import LoraSettings
from miniverl.objectives.gkd import GkdObjective
from miniverl.objectives.pg_k1 import PgK1Objective
from miniverl.objectives.ratios import SamplerTolerance
from miniverl.process import ProcessSettings
from miniverl.rewards import ExactMatchReward
from miniverl.rollout.sampling import SamplingParams
from miniverl.step.conformance import GapStats, conformance_gate, decide, gap_stats
from miniverl.step.controller import StrictSyncController
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0)
CPU = ProcessSettings("cpu", torch_threads=1)  # see conftest: one thread for tiny models
TOL = SamplerTolerance(mean_gap=0.02, p99_gap=0.1, outside_frac=1e-3, cap=2.0, truncated=False)


def pg_k1(is_cap: float) -> PgK1Objective:
    return PgK1Objective(discount=0.0, is_cap=is_cap, kl_coef=0.0, kl_kind="k1", reward_coef=0.0)


def stats(mean: float, p99: float = 0.0, outside: float = 0.0) -> GapStats:
    return GapStats(mean_gap=mean, p99_gap=p99, outside_frac=outside, cap=2.0, tokens=300)


def test_gap_stats_closed_form():
    sampler = torch.tensor([[-1.0, -2.0, -3.0, 0.0]])
    learner = torch.tensor([[-1.5, -2.0, -2.0, -9.0]])  # gaps 0.5, 0, 1 and a masked-out 9
    mask = torch.tensor([[1, 1, 1, 0]])
    s = gap_stats(sampler, learner, mask, cap=2.0)
    assert s.tokens == 3 and s.mean_gap == pytest.approx(0.5)
    assert s.p99_gap == pytest.approx(torch.quantile(torch.tensor([0.0, 0.5, 1.0]), 0.99).item())
    assert s.outside_frac == pytest.approx(1 / 3)  # only |log ratio| = 1 > log 2
    with pytest.raises(ValueError, match="no sampled tokens"):
        gap_stats(sampler, learner, torch.zeros_like(mask), cap=2.0)


def test_objectives_declare_their_tolerance():
    assert pg_k1(2.0).sampler_tolerance.truncated and pg_k1(2.0).sampler_tolerance.cap == 2.0
    off = pg_k1(math.inf).sampler_tolerance
    assert not off.truncated and math.isfinite(off.cap)
    gkd = GkdObjective(0.5, 1.0, 0).sampler_tolerance
    assert not gkd.truncated and gkd.mean_gap > pg_k1(2.0).sampler_tolerance.mean_gap  # GKD never uses the ratio


def test_within_tolerance_passes():
    assert decide(stats(0.01, 0.05), TOL, "pg_k1", "hf_cached") == "pass"


def test_pg_k1_without_truncation_refuses_a_backend_outside_its_tolerance():
    """bf16 vLLM against HF (DESIGN.md: mean 0.08, p99 0.28) with objective.is_cap=inf."""
    tol = pg_k1(math.inf).sampler_tolerance
    with pytest.raises(ConfigError) as err:
        decide(stats(0.08, 0.28, 0.002), tol, "pg_k1", "vllm")
    msg = str(err.value)
    for part in ("rollout backend vllm", "pg_k1", "mean 0.08", "p99 0.28", "0.20%", "[1/2, 2]", "objective.is_cap"):
        assert part in msg, part


def test_pg_k1_with_truncation_passes_the_same_backend_with_tis():
    assert decide(stats(0.08, 0.28, 0.002), pg_k1(2.0).sampler_tolerance, "pg_k1", "vllm") == "pass_with_tis"


def test_each_bound_alone_fails_the_gate():
    for bad in (stats(0.05), stats(0.01, p99=0.2), stats(0.01, outside=0.01)):
        with pytest.raises(ConfigError, match="conformance gate"):
            decide(bad, TOL, "pg_k1", "hf_cached")


def test_gkd_refuses_a_sampler_that_is_another_policy():
    """A bf16 base served against an NF4 learner (DESIGN.md: mean 1.66, 75% of ratios outside [0.5, 2])."""
    with pytest.raises(ConfigError, match=r"mean 1\.66 .* 75\.00%") as err:
        decide(stats(1.66, 4.0, 0.75), GkdObjective(0.5, 1.0, 0).sampler_tolerance, "gkd", "vllm")
    assert "objective.is_cap" not in str(err.value)  # GKD has no ratio to truncate
    assert decide(stats(0.08, 0.28, 0.002), GkdObjective(0.5, 1.0, 0).sampler_tolerance, "gkd", "vllm") == "pass"


@pytest.mark.parametrize("backend", ["hf_reference", "hf_cached"])
def test_gate_on_real_backends_passes_in_fp32(student_dir, teacher_dir, backend):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    texts = ["abc>", "de>", "fgh>"]
    prompts = PromptBatch([tok(t)["input_ids"] for t in texts], ["a", "b", "c"], ["cba", "ed", "hgf"])
    objective = pg_k1(math.inf)  # the strictest setting: no truncation to fall back on
    learner = LearnerWorker(str(student_dir), LORA, "float32", objective, 1e-3, 0.0, 1.0, 4, CPU)
    rollout = RolloutWorker(backend, str(student_dir), LORA, "float32", CPU)
    ctl = StrictSyncController(
        rollout, ScorerWorker(str(teacher_dir), "float32", 4, CPU), learner, ExactMatchReward(tok), None, 1.0
    )
    params = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    lines = []
    out = conformance_gate(ctl, prompts, params, objective, ("pg_k1", backend), lines.append)
    assert out["decision"] == "pass" and out["tokens"] > 6
    assert out["mean_gap"] < 1e-5 and out["p99_gap"] < 1e-4 and out["outside_frac"] == 0.0
    assert out["tolerance"]["truncated"] is False
    assert f"conformance gate: {backend} vs learner" in lines[0] and "pass" in lines[0]
    assert out["teacher_repeat"]["sampled_mean"] == 0.0 and "teacher self-test" in lines[1]  # fp32 repeats exactly
    assert learner.version == 0  # the gate samples; it never trains


def test_is_cap_inf_in_config_turns_truncation_off():
    from miniverl.objectives import build_objective
    from tests.test_config import load

    assert not build_objective(load("+experiment=pg_k1", "objective.is_cap=inf").objective).sampler_tolerance.truncated
    assert build_objective(load("+experiment=pg_k1").objective).sampler_tolerance.truncated


def test_gate_on_a_real_bf16_sampler_against_an_fp32_learner(student_dir, teacher_dir):
    """A real replica computing in bf16 passes the probe (its bf16 tolerance), and its sampled-token
    gaps to an fp32 learner are measured. Held against a tolerance tighter than bf16 rounding: refused
    without truncation (naming the numbers), passed with TIS. (On the built-in student the same setup
    sits at PG-k1's own p99 bound: lab/measurements/measure_gate.py.)"""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    texts = ["abc>", "de>", "fgh>", "ij>", "klmn>", "op>"]
    prompts = PromptBatch([tok(t)["input_ids"] for t in texts], texts, texts)
    params = SamplingParams(n=4, max_new_tokens=8, stop_token_ids=(tok.eos_token_id,))
    scorer = ScorerWorker(str(teacher_dir), "float32", 4, CPU)
    rollout = RolloutWorker("hf_cached", str(student_dir), LORA, "bfloat16", CPU)
    tight = dict(mean_gap=1e-4, p99_gap=1e-3, outside_frac=1e-3, cap=2.0)
    for truncated in (False, True):
        objective = pg_k1(2.0 if truncated else math.inf)
        objective.sampler_tolerance = SamplerTolerance(**tight, truncated=truncated)
        learner = LearnerWorker(str(student_dir), LORA, "float32", objective, 1e-3, 0.0, 1.0, 4, CPU)
        ctl = StrictSyncController(rollout, scorer, learner, ExactMatchReward(tok), None, 1.0)
        if not truncated:
            with pytest.raises(ConfigError, match=r"hf_cached fails objective pg_k1's .* mean \d"):
                conformance_gate(ctl, prompts, params, objective, ("pg_k1", "hf_cached"), lambda *_: None)
        else:
            out = conformance_gate(ctl, prompts, params, objective, ("pg_k1", "hf_cached"), lambda *_: None)
            assert out["decision"] == "pass_with_tis" and out["mean_gap"] > tight["mean_gap"]


def test_truncation_does_not_excuse_a_sampler_that_is_another_policy():
    """The NF4-vs-bf16 mismatch (mean 1.66, 75% of ratios outside [1/2, 2]) passed main's gate "with TIS"."""
    with pytest.raises(ConfigError, match=r"even with truncated .* mean 1\.66 .* 75\.00% .* at most mean 0\.25"):
        decide(stats(1.66, 4.0, 0.75), pg_k1(2.0).sampler_tolerance, "pg_k1", "vllm")
    with pytest.raises(ConfigError, match="even with truncated"):
        decide(stats(0.1, 0.3, 0.2), pg_k1(2.0).sampler_tolerance, "pg_k1", "vllm")  # most ratios fine, a fifth not


def test_the_learner_refuses_a_step_whose_sampler_gap_is_beyond_the_objective(parts, student_dir):
    """Enforced on every step before optimizer.step(), with the numbers (main only logged it)."""
    from miniverl.objectives.sampler_check import SamplerGapError

    _, prompts, learner, scorer = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    rollout.load_policy(learner.publish_policy())
    batch = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, stop_token_ids=(2,)))
    scores = scorer.score(batch, 0, 1.0)
    before = {k: v.clone() for k, v in learner.model.named_parameters() if v.requires_grad}
    batch.rollout_log_probs -= 0.6 * batch.response_mask  # GKD tolerates a mean gap of 0.5 nats
    with pytest.raises(
        SamplerGapError, match=r"tokens sit mean 0\.6 nats \(max 0\.6.*v0, above the objective's .*mean 0\.5"
    ):
        learner.update(batch, scores, None)
    assert learner.version == 0
    assert all(torch.equal(v, before[k]) for k, v in learner.model.named_parameters() if v.requires_grad)
    batch.rollout_log_probs += 0.6 * batch.response_mask
    batch.rollout_log_probs[0, 0] = float("nan")  # a NaN mean passed `mean > bound` (issue 33)
    with pytest.raises(SamplerGapError, match=r"not finite against the learner's v0 \(mean gap nan"):
        learner.update(batch, scores, None)
    assert all(torch.equal(v, before[k]) for k, v in learner.model.named_parameters() if v.requires_grad)
