"""The chunked learner path (trainer.logprob_chunk_tokens > 0) and gradient checkpointing change memory,
never numbers: the same loss, metrics and adapter gradients as the direct path, for every objective, at
chunk sizes that divide the response length and ones that do not."""

from __future__ import annotations

import pytest
import torch

from miniverl.models.logprobs import chunked_token_terms, policy_token_terms, response_logits, token_logprobs
from miniverl.protocol import ConfigError
from tests.objectives.test_objective_invariances import (
    REWARDS,
    assert_same,
    make_learner,
    objectives,
    on_policy_batch,
    two_updates,
)

# Responses here are at most 5 tokens (max_new_tokens=5): 1 and 5 divide it, 2 and 3 do not, 7 exceeds it.
CHUNKS = (1, 2, 3, 7)
# Adam divides by sqrt(v): a 1e-7 gradient difference moved one weight by 2.4e-5 after two steps (lr 1e-2),
# so the comparison (assert_same: gradients at atol, weights at 10 x atol) uses atol 1e-5.


def learner_with(student_dir, objective, chunk: int, checkpointing: bool = False):
    torch.manual_seed(0)
    learner = make_learner(student_dir, objective, 4)
    learner.chunk_tokens = chunk
    if checkpointing:
        learner.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return learner


@pytest.fixture(scope="module")
def data(student_dir, random_model_dir):
    """The invariance tests' on-policy batch (rows of different lengths, at most 5 tokens) and scorer."""
    return on_policy_batch(student_dir, random_model_dir)


@pytest.fixture(scope="module")
def scored(data):
    """The invariance tests' batch, scored for each objective's support."""
    batch, scorer = data
    return {
        name: (batch, scorer.score(batch, obj.teacher_support_k, obj.loss_temperature))
        for name, obj in objectives().items()
    }


@pytest.mark.parametrize("name", ["gkd_full", "gkd_top8", "pg_k1"])
def test_chunked_path_gives_the_direct_loss_and_gradients(student_dir, scored, name):
    batch, scores = scored[name]
    assert batch.responses.shape[1] == 5
    direct = two_updates(learner_with(student_dir, objectives()[name], 0), batch, scores, REWARDS)
    assert direct[0][0]["loss"] != 0.0 and any(g.abs().max() > 0 for g in direct[1][0])
    for chunk in CHUNKS:
        chunked = two_updates(learner_with(student_dir, objectives()[name], chunk), batch, scores, REWARDS)
        assert_same(direct, chunked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gkd_top8", "pg_k1"])
def test_gradient_checkpointing_gives_the_same_gradients(student_dir, scored, name):
    batch, scores = scored[name]
    plain = two_updates(learner_with(student_dir, objectives()[name], 0), batch, scores, REWARDS)
    for chunk in (0, 2):
        ckpt = two_updates(learner_with(student_dir, objectives()[name], chunk, True), batch, scores, REWARDS)
        assert_same(plain, ckpt, rtol=1e-5, atol=1e-5)


def test_learner_switches_checkpointing_on_from_its_argument(student_dir):
    from miniverl.workers.learner import LearnerWorker
    from tests.objectives.test_objective_invariances import CPU, LORA

    args = (str(student_dir), LORA, "float32", objectives()["pg_k1"], 1e-2, 0.0, 1.0, 4, CPU)
    on = LearnerWorker(*args, logprob_chunk_tokens=3, gradient_checkpointing=True)
    off = LearnerWorker(*args)
    assert on.model.get_base_model().is_gradient_checkpointing and on.chunk_tokens == 3
    assert not off.model.get_base_model().is_gradient_checkpointing and off.chunk_tokens == 0


def test_chunked_logprobs_match_and_never_hold_more_than_one_chunk(student_dir, data):
    """Forward-only (the reference/teacher path): equal log-probs, and the LM head sees at most
    chunk_tokens positions per call."""
    from transformers import AutoModelForCausalLM

    batch, _ = data
    model = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    with torch.no_grad():
        want = token_logprobs(response_logits(model, batch), batch.responses)
        seen.clear()
        got, terms = policy_token_terms(model, batch, None, None, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert terms is None and seen == [2, 2, 1]


def test_bad_chunk_sizes_and_logit_transforms_are_refused(student_dir, data):
    from transformers import AutoModelForCausalLM

    batch, _ = data
    model = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_token_terms(torch.zeros(1, 2, 3), torch.nn.Identity(), torch.zeros(1, 2, dtype=torch.long), 0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="trainer.logprob_chunk_tokens=0"):
        policy_token_terms(model, batch, None, None, 2)


@pytest.mark.parametrize("support_k", [None, 0, 8])
def test_chunked_teacher_scores_equal_the_direct_ones(data, support_k, random_model_dir):
    from miniverl.workers.scorer import ScorerWorker
    from tests.objectives.test_objective_invariances import CPU

    batch, direct = data
    chunked = ScorerWorker(str(random_model_dir), "float32", 4, CPU, chunk_tokens=2)
    want, got = direct.score(batch, support_k, 1.5), chunked.score(batch, support_k, 1.5)
    for name in ("teacher_log_probs", "teacher_topk_logprobs", "teacher_topk_ids", "teacher_tail_logprob"):
        a, b = getattr(want, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert got.teacher_log_probs.shape == batch.responses.shape


@pytest.mark.slow
def test_memory_switches_reach_the_actors_and_change_no_number(tmp_path, student_dir, teacher_dir):
    """`python -m miniverl.main` through Ray with chunked log-probs (learner and scorer) and gradient
    checkpointing logs the same losses and KLs as the direct run; that the chunk size reaches each actor
    is shown by a model the chunked path must refuse (logit soft-capping), as student and as teacher."""
    import json
    import shutil

    from tests.test_main import TINY, run_main

    for role, src in (("student", student_dir), ("teacher", teacher_dir)):
        capped = tmp_path / f"capped_{role}"
        shutil.copytree(src, capped)
        config = json.loads((capped / "config.json").read_text())
        (capped / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
        paths = {"student": student_dir, "teacher": teacher_dir, role: capped}
        proc = run_main(
            "+experiment=gkd",
            "trainer=smoke",
            f"model.student.path={paths['student']}",
            f"model.teacher.path={paths['teacher']}",
            "tracking=disabled",
            "trainer.save_checkpoint=false",
            "trainer.logprob_chunk_tokens=4",
            *TINY,
            f"hydra.run.dir={tmp_path / role}",
        )
        assert proc.returncode != 0 and "set trainer.logprob_chunk_tokens=0" in proc.stdout + proc.stderr, role

    runs = {}
    switches = ("trainer.logprob_chunk_tokens=4", "trainer.gradient_checkpointing=true")
    for name, extra in (("direct", ()), ("chunked", switches)):
        run_dir = tmp_path / name
        proc = run_main(
            "+experiment=pg_k1",
            "trainer=smoke",
            "objective.kl_coef=0.1",  # the reference (adapter off) log-probs take the chunked path too
            f"model.student.path={student_dir}",
            f"model.teacher.path={teacher_dir}",
            "tracking=disabled",
            "trainer.save_checkpoint=false",
            *TINY,
            *extra,
            f"hydra.run.dir={run_dir}",
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["direct"]) == len(runs["chunked"]) == 4
    for a, b in zip(runs["direct"][1:], runs["chunked"][1:]):
        assert a["loss"] != 0.0
        for key in ("loss", "reverse_kl", "sampler_gap_mean", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
