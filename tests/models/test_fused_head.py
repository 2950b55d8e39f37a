"""The learner's fused LM-head loss on token-budget micro-batches (models/fused_head.py, models/packing.py)
changes memory and speed, never numbers: the same loss, metrics and adapter gradients as the direct reference
(the model's own forward over the left-padded batch, [B, Tr, V] logits, the objective's `loss`), for every
objective, at chunk sizes that divide the step's tokens and ones that do not, at any token budget, with and
without gradient checkpointing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miniverl.errors import ConfigError
from miniverl.models.fused_head import check_fusable, fused_head_loss, head_logprobs
from miniverl.models.logprobs import response_logits, token_logprobs
from miniverl.models.packing import pack_rows, plan_micro_batches, row_lengths
from tests.objectives.test_objective_invariances import (
    REWARDS,
    assert_same,
    capture_gradients,
    make_learner,
    objectives,
    on_policy_batch,
    two_updates,
)

# Responses here are at most 5 tokens over 8 rows: 1 and 3 split the step's tokens unevenly, 1000 exceeds them.
CHUNKS = (1, 3, 1000)
# Adam divides by sqrt(v): a 1e-7 gradient difference moved one weight by 2.4e-5 after two steps (lr 1e-2),
# so the comparison (assert_same: gradients at atol, weights at 10 x atol) uses atol 1e-5.


def direct_update(learner, batch, scores, rewards, num_step_tokens=None):
    """The learner's step computed the direct way: [b, Tr, V] logits from the model's own forward over the
    left-padded rows (attention mask, position ids), log-probs and the objective's `loss` on them."""
    ref = learner._reference_logprobs(batch) if learner.objective.needs_reference else None
    adv = learner.objective.prepare(batch, scores, rewards, ref)
    n = int(batch.response_mask.sum())
    total, metrics = 0.0, {}
    learner.model.train()
    for s in range(0, len(batch), learner.micro_batch_size):
        mb, sc = batch.rows(s, s + learner.micro_batch_size), scores.rows(s, s + learner.micro_batch_size)
        logits = response_logits(learner.model, mb)  # [b, Tr, V]
        lp = token_logprobs(logits, mb.responses)
        a = None if adv is None else adv[s : s + learner.micro_batch_size]
        loss, m = learner.objective.loss(logits, lp, mb, sc, a, n)
        loss.backward()
        total += loss.item()
        share = mb.response_mask.sum().item() / n
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v) * share
    torch.nn.utils.clip_grad_norm_(learner.params, learner.max_grad_norm)
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    learner.version += 1
    return {"loss": total, "response_tokens": n, **metrics}


def learner_with(student_dir, objective, chunk: int, max_tokens: int = 0, checkpointing: bool = False):
    torch.manual_seed(0)
    learner = make_learner(student_dir, objective, 4)
    learner.chunk_tokens, learner.max_tokens = chunk, max_tokens
    if checkpointing:
        learner.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return learner


def reference_updates(student_dir, objective, batch, scores):
    """two_updates through direct_update, with the sampler gap the fused learner reports recomputed."""
    learner = learner_with(student_dir, objective, 0)
    grads = capture_gradients(learner)
    metrics = []
    for version in range(2):
        stamped = dataclasses.replace(batch, policy_version=version)
        with torch.no_grad():
            lp = token_logprobs(response_logits(learner.model.eval(), stamped), stamped.responses)
        mask = stamped.response_mask.bool()
        gap = (lp - stamped.rollout_log_probs).abs()[mask].sum().item() / mask.sum().item()
        metrics.append({**direct_update(learner, stamped, scores, REWARDS), "sampler_gap_mean": gap})
    return metrics, grads, [p.detach().clone() for p in learner.params]


@pytest.fixture(scope="module")
def data(student_dir, random_model_dir):
    """The invariance tests' on-policy batch (rows of different lengths, at most 5 tokens) and scorer."""
    return on_policy_batch(student_dir, random_model_dir)


@pytest.fixture(scope="module")
def scored(data):
    batch, scorer = data
    return {
        name: (batch, scorer.score(batch, obj.teacher_support_k, obj.loss_temperature))
        for name, obj in objectives().items()
    }


@pytest.mark.parametrize("name", ["gkd_full", "gkd_top8", "pg_k1"])
def test_fused_path_gives_the_direct_loss_and_gradients(student_dir, scored, name):
    batch, scores = scored[name]
    assert batch.responses.shape[1] == 5
    want = reference_updates(student_dir, objectives()[name], batch, scores)
    assert want[0][0]["loss"] != 0.0 and any(g.abs().max() > 0 for g in want[1][0])
    for chunk in CHUNKS:
        got = two_updates(learner_with(student_dir, objectives()[name], chunk), batch, scores, REWARDS)
        assert_same(want, got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gkd_top8", "pg_k1"])
def test_token_budget_and_checkpointing_change_no_number(student_dir, scored, name):
    batch, scores = scored[name]
    plain = two_updates(learner_with(student_dir, objectives()[name], 0), batch, scores, REWARDS)
    longest = max(row_lengths(batch))
    for budget in (1, longest, 3 * longest, 10_000):  # one row per forward ... the whole batch in one
        for ckpt in (False, True):
            got = two_updates(learner_with(student_dir, objectives()[name], 2, budget, ckpt), batch, scores, REWARDS)
            assert_same(plain, got, rtol=1e-5, atol=1e-5)


def test_plan_groups_longest_rows_first_under_the_budget():
    assert plan_micro_batches([3, 5, 2, 5, 1], 10) == [[1, 3], [0, 2, 4]]  # 2 x 5 <= 10, then 3 x 3 <= 10
    assert plan_micro_batches([4, 4, 4], 1) == [[0], [1], [2]]  # a row over the budget goes alone
    # A last group of one row takes the shortest of the group before (the compiled layers' size-1 variants):
    # greedily [[0, 1, 2], [3]]; 2 x 3 <= 9 still fits
    assert plan_micro_batches([3, 3, 3, 2], 9) == [[0, 1], [2, 3]]
    assert plan_micro_batches([5, 4, 2], 8) == [[0], [1, 2]]  # a lone row that is not the last stays (2 x 5 > 8)
    assert plan_micro_batches([5, 5, 1], 10) == [[0, 1], [2]]  # the group before keeps fewer than two: left
    assert plan_micro_batches([7], 3) == [[0]]
    assert plan_micro_batches([], 8) == []
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        plan_micro_batches([1], 0)


def test_packed_rows_put_each_response_token_after_its_prompt(data):
    batch, _ = data
    rows = [3, 0]
    packed = pack_rows(batch, rows)
    for j, i in enumerate(rows):
        p = int(batch.prompt_mask[i].sum())
        r = int(batch.response_mask[i].sum())
        prompt = batch.prompts[i, batch.prompts.shape[1] - p :]
        assert packed.input_ids[j, :p].tolist() == prompt.tolist()
        assert packed.input_ids[j, p : p + r].tolist() == batch.responses[i, :r].tolist()
        assert (packed.input_ids[j, p + r :] == 0).all()
    width = packed.input_ids.shape[1]
    flat = packed.input_ids.reshape(-1)
    # the position after each predictor holds the token it predicts
    assert flat[packed.predictors + 1].tolist() == packed.targets.tolist()
    assert packed.num_tokens == int(batch.response_mask[rows].sum()) and width == max(
        row_lengths(batch)[i] for i in rows
    )


def test_head_sees_one_chunk_at_a_time_forward_and_backward(monkeypatch):
    """No [N, V] tensor: the LM head is applied to chunk_tokens positions at a time (the closed-form path: once
    for the numbers the loss reads, once for their gradient), and backward reuses the gradient computed in
    forward (it applies the head no more)."""
    from miniverl.models import fused_head

    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=False).requires_grad_(False)
    hidden = torch.randn(7, 6, requires_grad=True)
    ids = torch.randint(0, 11, (7,))
    seen = []
    linear = fused_head.F.linear

    def counting(x, w, b=None):
        seen.append((*x.shape[:-1], w.shape[0]))
        return linear(x, w, b)

    monkeypatch.setattr(fused_head.F, "linear", counting)
    loss, lp, _ = fused_head_loss(hidden, head, ids, 3, None, lambda lp, t, pos: -lp)
    assert seen == [(3, 11), (3, 11), (1, 11)] * 2
    loss.backward()
    assert len(seen) == 6
    monkeypatch.undo()
    want_lp = torch.log_softmax(hidden.detach() @ head.weight.T, -1).gather(-1, ids[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, want_lp)
    h2 = hidden.detach().clone().requires_grad_()
    (-torch.log_softmax(h2 @ head.weight.T, -1).gather(-1, ids[:, None]).sum()).backward()
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(head_logprobs(hidden.detach(), head, ids, 2), want_lp)


def test_fused_head_refuses_trainable_or_foreign_heads():
    head = torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match="keep lm_head frozen"):
        check_fusable(head)
    with pytest.raises(ValueError, match="plain nn.Linear head"):
        check_fusable(torch.nn.Sequential(head))


def test_learner_switches_checkpointing_and_budget_on_from_its_arguments(student_dir):
    from miniverl.workers.learner import LearnerWorker
    from tests.objectives.test_objective_invariances import CPU, LORA

    args = (str(student_dir), LORA, "float32", objectives()["pg_k1"], 1e-2, 0.0, 1.0, 4, CPU)
    on = LearnerWorker(*args, logprob_chunk_tokens=3, gradient_checkpointing=True, max_tokens_per_micro_batch=64)
    off = LearnerWorker(*args)
    assert on.model.get_base_model().is_gradient_checkpointing and (on.chunk_tokens, on.max_tokens) == (3, 64)
    assert not off.model.get_base_model().is_gradient_checkpointing and (off.chunk_tokens, off.max_tokens) == (0, 0)


def test_logit_transforms_are_refused(student_dir, data):
    from transformers import AutoModelForCausalLM

    from miniverl.models.logprobs import packed_logprobs

    batch, _ = data
    model = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        packed_logprobs(model, pack_rows(batch, [0]), 2)


@pytest.mark.parametrize("support_k", [None, 0, 8])
def test_teacher_scores_equal_the_direct_ones_at_any_chunk_and_budget(data, support_k, random_model_dir):
    from miniverl.workers.scorer import ScorerWorker
    from tests.objectives.test_objective_invariances import CPU

    batch, scorer = data
    logits = response_logits(scorer.model, batch).detach()  # [B, Tr, V], the direct way
    mask = batch.response_mask.bool()
    want_lp = token_logprobs(logits, batch.responses) * mask
    # temperature 1 takes the top-K straight from the logits (two vocabulary passes); 1.5 the log-softmax path
    for chunk, budget, temperature in ((0, 0, 1.5), (2, 0, 1.5), (3, 7, 1.5), (0, 0, 1.0), (3, 7, 1.0)):
        full = torch.log_softmax(logits.float() / temperature, dim=-1)
        got = ScorerWorker(
            str(random_model_dir), "float32", 4, CPU, chunk_tokens=chunk, max_tokens_per_micro_batch=budget
        ).score(batch, support_k, temperature)
        torch.testing.assert_close(got.teacher_log_probs, want_lp, rtol=1e-5, atol=1e-6)
        if support_k is None:
            assert got.teacher_topk_logprobs is None
        elif support_k == 0:
            torch.testing.assert_close(got.teacher_topk_logprobs[mask], full[mask], rtol=1e-5, atol=1e-6)
            assert got.teacher_topk_ids is None
        else:
            top, ids = full.topk(support_k, dim=-1)
            torch.testing.assert_close(got.teacher_topk_logprobs[mask], top[mask], rtol=1e-5, atol=1e-6)
            assert torch.equal(got.teacher_topk_ids[mask], ids[mask])
            tail = torch.logsumexp(full.scatter(-1, ids, float("-inf")), dim=-1)
            torch.testing.assert_close(got.teacher_tail_logprob[mask], tail[mask], rtol=1e-5, atol=1e-6)
        assert got.teacher_log_probs.shape == batch.responses.shape


@pytest.mark.slow
def test_memory_switches_reach_the_actors_and_change_no_number(tmp_path, student_dir, teacher_dir):
    """`python -m miniverl.main` through Ray with LM-head chunks, a token budget (learner and scorer) and
    gradient checkpointing logs the same losses and KLs as the plain run; a model whose logits are not
    lm_head(hidden) (logit soft-capping) is refused before Ray, as student and as teacher."""
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
            *TINY,
            f"hydra.run.dir={tmp_path / role}",
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and f"model.{role}.path=" in out and "final_logit_softcapping" in out, role
        assert "Started a local Ray" not in out, role

    runs = {}
    switches = (
        "trainer.logprob_chunk_tokens=4",
        "trainer.gradient_checkpointing=true",
        "trainer.max_tokens_per_micro_batch=40",
    )
    for name, extra in (("plain", ()), ("fused", switches)):
        run_dir = tmp_path / name
        proc = run_main(
            "+experiment=pg_k1",
            "trainer=smoke",
            "objective.kl_coef=0.1",  # the reference (adapter off) log-probs take the same path
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
    assert len(runs["plain"]) == len(runs["fused"]) == 4
    for a, b in zip(runs["plain"][1:], runs["fused"][1:]):
        assert a["loss"] != 0.0
        for key in ("loss", "reverse_kl", "sampler_gap_mean", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_probe_logprobs_match_the_models_own_logits(student_dir, monkeypatch):
    """sequence_logprobs (the learner's and hf_reference's probe): the decoder once over right-padded ragged
    rows and the LM head in chunks gives the log-probs of the model's own forward over each row alone."""
    from miniverl.models import logprobs
    from miniverl.models.lora import build_lora_model
    from tests.step.test_controller import LORA

    model = build_lora_model(str(student_dir), LORA, torch.float32, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained-looking adapter, so the LoRA term is in the numbers
    model.eval()
    monkeypatch.setattr(logprobs, "SEQUENCE_CHUNK_TOKENS", 3)  # chunks that split rows
    sequences = [[1, 5, 7, 2, 9, 4], [3, 8], [6, 6, 1, 2]]
    got = logprobs.sequence_logprobs(model, sequences)
    assert [len(g) for g in got] == [len(s) - 1 for s in sequences]
    with torch.no_grad():
        for s, g in zip(sequences, got):
            ids = torch.tensor([s])
            want = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
            assert torch.allclose(torch.tensor(g), want, atol=1e-5), (s, g, want.tolist())


def test_an_update_that_runs_out_of_memory_is_redone_at_a_smaller_budget(student_dir, scored, monkeypatch, capsys):
    """Fragmentation can take a share the memory model said fits (the 4080 recipe's first update, 2026-12-02):
    the update drops its partial gradients and is redone at OOM_SHRINK x the budget, which then stays, and the
    step equals the plain one; a budget that cannot shrink below the longest row stops with the fix named."""
    from miniverl.errors import MiniVerlError
    from miniverl.workers import learner as learner_module
    from miniverl.workers.token_budget import OOM_SHRINK

    batch, scores = scored["pg_k1"]
    plain = two_updates(learner_with(student_dir, objectives()["pg_k1"], 2), batch, scores, REWARDS)
    longest = max(row_lengths(batch))
    budget = 3 * longest
    real = learner_module.packed_token_loss
    sizes = []

    def tight(model, b, packed, *args):  # the second micro-batch of a try at the first budget runs out of memory
        sizes.append(packed.input_ids.numel())
        if learner.max_tokens == budget and len(sizes) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 184.00 MiB (simulated)")
        return real(model, b, packed, *args)

    monkeypatch.setattr(learner_module, "packed_token_loss", tight)
    learner = learner_with(student_dir, objectives()["pg_k1"], 2, budget)
    got = two_updates(learner, batch, scores, REWARDS)
    # the first micro-batch's gradients were accumulated before the failure: equal steps prove they were dropped
    assert_same(plain, got, rtol=1e-5, atol=1e-5)
    assert learner.max_tokens == int(budget * OOM_SHRINK) and got[0][0]["micro_batch_tokens"] > 0
    assert "redoing this update at" in capsys.readouterr().out
    assert max(sizes) > int(budget * OOM_SHRINK)  # the first try really used the larger micro-batches

    stuck = learner_with(student_dir, objectives()["pg_k1"], 2, longest)  # cannot shrink below one row
    monkeypatch.setattr(
        learner_module, "packed_token_loss", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("x"))
    )
    stuck.publish_policy()
    with pytest.raises(MiniVerlError, match="cannot shrink them .*the longest row has .*resources.learner.num_gpus"):
        stuck.update(batch, scores, REWARDS)
    assert all(p.grad is None for p in stuck.params) and stuck.version == 0  # nothing applied


def test_the_scorer_sizes_its_forwards_for_the_support_it_is_built_for_and_refuses_a_share_too_small(
    random_model_dir, monkeypatch
):
    """The sizing a scorer runs on a GPU (called here with an emulated share on the CPU): the chunk is counted in
    the dtype its path keeps (bf16 logits with the Triton passes for sampled log-probs or a top-K at temperature
    1; fp32 copies for a full support), and a share that cannot hold one row is refused with the fixes instead
    of scoring a row per forward (the 4080 recipe's qlora-4080.md run 6)."""
    from miniverl.models import vocab_kernels
    from miniverl.models.sizing import LearnerShape, scorer_tokens
    from miniverl.process import ProcessSettings
    from miniverl.workers.scorer import ScorerWorker
    from tests.objectives.test_objective_invariances import CPU

    monkeypatch.setattr(vocab_kernels, "kernels_available", lambda: True)
    scorer = ScorerWorker(str(random_model_dir), "float32", 4, CPU, chunk_tokens=8, max_row_tokens=24)
    config = scorer.model.config
    shape = LearnerShape(
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size,
        scorer.weight_bytes(), 0,
    )  # fmt: skip
    share = ProcessSettings("cpu", gpu_memory_gib=(scorer.weight_bytes() + 2**20) / 0.8 / 2**30)
    for support_k, temperature, entry in ((None, 1.0, 4), (3, 1.0, 4), (3, 2.0, 16), (0, 1.0, 16)):
        scorer.support_k, scorer.loss_temperature = support_k, temperature
        assert scorer._size_micro_batches(share) == scorer_tokens(shape, int(share.gpu_memory_gib * 2**30), 8, entry)
    scorer.max_tokens = 16  # an explicit budget below what fits is kept
    assert scorer._size_micro_batches(share) == 16
    tiny = ProcessSettings("cpu", gpu_memory_gib=scorer.weight_bytes() / 0.8 / 2**30)
    with pytest.raises(ConfigError, match="cannot hold one row of 24 tokens.*resources.scorer.num_gpus"):
        scorer._size_micro_batches(tiny)
