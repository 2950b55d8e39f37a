"""The strict-sync probe: its bookkeeping (pure), and real backends that serve the wrong weights being caught."""

from __future__ import annotations

import pytest
import torch

from miniverl.errors import PolicyMismatchError
from miniverl.models.lora import LoraSettings, adapter_state, load_adapter_state
from miniverl.objectives.gkd import GkdObjective
from miniverl.policy import weights_digest
from miniverl.process import ProcessSettings
from miniverl.rewards import ExactMatchReward
from miniverl.rollout.sampling import SamplingParams
from miniverl.served_policy import (
    CHANGE_MARGIN,
    FP32_PROBE_TOLERANCE,
    HALF_PROBE_TOLERANCE,
    PROBE_SEQUENCES,
    TAIL_FACTOR,
    TAIL_LOGPROB,
    check_changed,
    check_gap,
    draw_probe,
    probe_tolerance,
)
from miniverl.step.controller import StrictSyncController
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0)
CPU = ProcessSettings("cpu", torch_threads=1)  # see conftest: one thread for tiny models
PARAMS = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=(2,))
TOL = 0.1  # a round tolerance for the pure bookkeeping tests


# --- bookkeeping (pure) -------------------------------------------------------------------------------


def test_probe_is_fixed_and_inside_the_vocabulary():
    a, b = draw_probe(40, 64), draw_probe(40, 64)
    assert a == b and len(a) == PROBE_SEQUENCES
    assert all(0 <= t < 40 for s in a for t in s)
    assert draw_probe(40, 64, seed=1) != a
    assert {len(s) for s in draw_probe(40, 8)} == {8}  # never longer than the model's positions
    with pytest.raises(ValueError, match="at least 2 tokens"):
        draw_probe(1, 64)


def test_tolerance_follows_the_dtype():
    assert probe_tolerance(torch.float32) == FP32_PROBE_TOLERANCE
    assert probe_tolerance(torch.bfloat16) == probe_tolerance(torch.float16) == HALF_PROBE_TOLERANCE


def test_match_within_tolerance_passes_and_reports_the_gap():
    assert check_gap(0, 3, [[-1.0, -2.05]], [[-1.0, -2.0]], TOL) == pytest.approx(0.05)


def test_gap_beyond_tolerance_names_replica_version_and_gap():
    with pytest.raises(PolicyMismatchError, match=r"replica 2 .* up to 0\.5 nats .* v7 .* tolerance is 0\.1"):
        check_gap(2, 7, [[-1.0, -2.5]], [[-1.0, -2.0]], TOL)


def test_tokens_the_policy_does_not_sample_are_held_to_twice_the_tolerance():
    """Issue 73: on a peaked real model in bf16 an honest replica's largest probe gaps sit on random-token positions
    at -16 to -23 nats (lab/results/probe-tolerance-real.md); there the bound is TAIL_FACTOR x the tolerance, while
    a token the learner gives at least TAIL_LOGPROB keeps the tolerance itself."""
    tol, tail = HALF_PROBE_TOLERANCE, TAIL_LOGPROB - 15.0
    honest = tol * TAIL_FACTOR - 0.1  # 1.4 nats in bf16
    assert check_gap(0, 96, [[-1.0, tail - honest]], [[-1.0, tail]], tol) == pytest.approx(honest / TAIL_FACTOR)
    with pytest.raises(
        PolicyMismatchError, match=r"up to 1\.4 nats .* v96 .* 2x that on tokens the learner gives less"
    ):
        check_gap(0, 96, [[-1.0 - honest, tail]], [[-1.0, tail]], tol)  # the same gap on a sampled token
    with pytest.raises(PolicyMismatchError, match=r"up to 1\.6 nats"):
        check_gap(0, 96, [[-1.0, tail - tol * TAIL_FACTOR - 0.1]], [[-1.0, tail]], tol)
    assert check_gap(0, 1, [[TAIL_LOGPROB - tol]], [[TAIL_LOGPROB]], tol) == pytest.approx(tol)  # the edge: sampled


@pytest.mark.parametrize(
    ("results", "honest"), [("probe-tolerance-real.json", True), ("probe-tolerance-real-4bit.json", False)]
)
def test_the_real_models_measured_probes_pass_honest_and_refuse_a_four_bit_base(results, honest):
    """The per-token probes kept in lab/results/probe-tolerance-real.md (SmolLM2-135M-Instruct, bf16, CPU): every
    honest one passes with over 2x margin, though its raw max (0.45-0.54 nats) was within 1.5x of the bound; a 4-bit
    base is refused, also on the fixed sequences alone (a first refresh has no on-policy rows)."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).parents[2] / "lab/results" / results).read_text())["rows"]
    for row in rows:
        t = row["per_token"]
        fixed = [i for i, on in enumerate(t["on_policy"]) if not on]
        probes = [
            ([t["served"]], [t["learner"]]),
            ([[t["served"][i] for i in fixed]], [[t["learner"][i] for i in fixed]]),
        ]
        for served, learner in probes:
            if honest:
                assert check_gap(0, 1, served, learner, HALF_PROBE_TOLERANCE) < HALF_PROBE_TOLERANCE / 2
            else:
                with pytest.raises(PolicyMismatchError, match="another base model or dtype"):
                    check_gap(0, 1, served, learner, HALF_PROBE_TOLERANCE)


def test_a_deterministic_replica_whose_probe_did_not_move_while_the_learner_moved_is_stale():
    """The change test has no tolerance of its own: its noise floor is the replica's determinism (0 here),
    so a learner move far below any gap tolerance (1e-4 nats) still exposes a bit-identical served probe."""
    with pytest.raises(PolicyMismatchError, match=r"replica 1 serves the probe log-probs of the previous .* v4"):
        check_changed(1, 4, served_moved=0.0, learner_moved=1e-4, noise=0.0)
    check_changed(1, 4, served_moved=1e-6, learner_moved=1e-4, noise=0.0)  # it moved: not stale
    check_changed(1, 4, served_moved=0.0, learner_moved=0.0, noise=0.0)  # nothing to follow


def test_a_noisy_replica_must_move_beyond_its_own_noise():
    noise = 1e-3  # e.g. an engine whose kernels are not batch-invariant
    with pytest.raises(PolicyMismatchError, match="within its own noise of 0.001"):
        check_changed(0, 2, served_moved=8e-4, learner_moved=0.05, noise=noise)
    check_changed(0, 2, served_moved=0.02, learner_moved=0.05, noise=noise)
    check_changed(0, 2, served_moved=8e-4, learner_moved=CHANGE_MARGIN * noise, noise=noise)  # learner within noise


def test_probe_rows_of_another_shape_are_refused():
    with pytest.raises(PolicyMismatchError, match="row lengths"):
        check_gap(0, 1, [[-1.0]], [[-1.0, -2.0]], TOL)


# --- real backends through the controller ---------------------------------------------------------------


def controller(rollout, parts, hide_digest: bool = False) -> StrictSyncController:
    """Every refresh probed (probe_every=1): these tests are about the probe. `hide_digest`: the replica reports
    no served digest (as vLLM), so the probe alone must catch what the digest would have caught first."""
    tok, _, learner, scorer = parts
    if hide_digest:
        rollout.backend.served_digest = lambda: None
    return StrictSyncController(rollout, scorer, learner, ExactMatchReward(tok), 0, 1.0, probe_every=1)


@pytest.mark.parametrize("backend", ["hf_reference", "hf_cached"])
def test_a_normal_run_passes_the_probe(parts, student_dir, backend):
    _, prompts, learner, _ = parts
    ctl = controller(RolloutWorker(backend, str(student_dir), LORA, "float32", CPU), parts)
    for _ in range(2):
        metrics = ctl.step(prompts, PARAMS)
        assert metrics["probe_gap_max"] <= FP32_PROBE_TOLERANCE
    assert ctl.last_probe["probe_learner_moved"] > FP32_PROBE_TOLERANCE  # the update moved the probe
    assert learner.version == 2


@pytest.mark.parametrize(
    ("hide_digest", "message"),
    [
        (False, r"replica 0 serves an adapter whose digest .* published v1"),
        (True, r"replica 0 serves probe log-probs up to .* v1"),
    ],
)
def test_hf_cached_whose_serving_weights_were_not_refreshed_is_caught(
    parts, student_dir, monkeypatch, hide_digest, message
):
    """The peft module holds the new adapter (a digest of what the replica was sent, or of its peft module, would
    pass) but the serving buffers it samples with are stale: the served digest, read from those buffers, stops
    the run; so does the probe, computed through them."""
    _, prompts, learner, _ = parts
    rollout = RolloutWorker("hf_cached", str(student_dir), LORA, "float32", CPU)
    ctl = controller(rollout, parts, hide_digest)
    ctl.step(prompts, PARAMS)  # v0 served honestly
    monkeypatch.setattr(
        rollout.backend.decoder, "load", lambda weights: load_adapter_state(rollout.backend.model, weights)
    )
    with pytest.raises(PolicyMismatchError, match=message):
        ctl.step(prompts, PARAMS)
    assert weights_digest(adapter_state(rollout.backend.model)) == learner.published.digest  # the old proof
    assert learner.version == 1  # no second update


def test_a_replica_serving_another_base_model_is_caught(parts, random_model_dir):
    _, prompts, learner, _ = parts
    ctl = controller(RolloutWorker("hf_cached", str(random_model_dir), LORA, "float32", CPU), parts)
    with pytest.raises(PolicyMismatchError, match="another base model or dtype"):
        ctl.step(prompts, PARAMS)
    assert learner.version == 0


def test_a_replica_serving_its_base_in_another_precision_is_caught(parts, student_dir):
    """Base weights rounded to bf16 (what a replica serving another precision holds) against an fp32
    learner: an adapter digest cannot see the base; the probe does."""
    _, prompts, learner, _ = parts
    rollout = RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    with torch.no_grad():
        for name, p in rollout.backend.model.named_parameters():
            if "lora_" not in name:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    with pytest.raises(PolicyMismatchError, match="replica 0"):
        controller(rollout, parts).step(prompts, PARAMS)
    assert learner.version == 0


@pytest.mark.parametrize("hide_digest", [False, True])
def test_weights_corrupted_in_transit_are_caught(parts, student_dir, hide_digest):
    class CorruptingWorker(RolloutWorker):
        """A broken weight sync: what arrives differs from what the learner published."""

        def load_policy(self, snapshot):
            bumped = {k: v + 0.05 if "lora_B" in k else v for k, v in snapshot.weights.items()}
            return super().load_policy(type(snapshot)(snapshot.identity, bumped))

    _, prompts, learner, _ = parts
    rollout = CorruptingWorker("hf_reference", str(student_dir), LORA, "float32", CPU)
    with pytest.raises(PolicyMismatchError, match="replica 0 serves (probe log-probs|an adapter whose digest)"):
        controller(rollout, parts, hide_digest).step(prompts, PARAMS)
    assert learner.version == 0


@pytest.mark.parametrize("hide_digest", [False, True])
def test_a_stale_replica_is_caught_among_honest_ones(parts, student_dir, monkeypatch, hide_digest):
    _, prompts, learner, scorer = parts
    engines = [RolloutWorker("hf_cached", str(student_dir), LORA, "float32", CPU) for _ in range(2)]
    for engine in engines if hide_digest else []:
        engine.backend.served_digest = lambda: None  # probed at every refresh, as vLLM
    ctl = StrictSyncController(engines, scorer, learner, ExactMatchReward(parts[0]), 0, 1.0)
    ctl.step(prompts, PARAMS)
    monkeypatch.setattr(engines[1].backend, "load_adapter", lambda weights: None)
    with pytest.raises(PolicyMismatchError, match="replica 1 "):
        ctl.step(prompts, PARAMS)


def test_an_honest_replica_passes_after_an_update_below_the_tolerance(parts, student_dir):
    """A tiny learning rate moves the learner's probe by far less than the tolerance: the served probe
    may then stay bit-identical (the merge rounds the update away), and that is not a stale engine."""
    tok, prompts, _, scorer = parts
    learner = LearnerWorker(str(student_dir), LORA, "float32", GkdObjective(0.5, 1.0, 0), 1e-9, 0.0, 1.0, 2, CPU)
    rollout = RolloutWorker("hf_cached", str(student_dir), LORA, "float32", CPU)
    ctl = StrictSyncController(rollout, scorer, learner, ExactMatchReward(tok), 0, 1.0, probe_every=1)
    for _ in range(3):
        ctl.step(prompts, PARAMS)
    assert learner.version == 3
    assert 0 <= ctl.last_probe["probe_learner_moved"] < FP32_PROBE_TOLERANCE
