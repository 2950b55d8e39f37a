"""The vocabulary-memory estimate (pure arithmetic) and the refusals built on it."""

from __future__ import annotations

import pytest
import torch

from miniverl.errors import ConfigError
from miniverl.models.memory import GIB, check_vocab_memory, learner_logits_bytes, teacher_support_bytes

QWEN_VOCAB = 151_936  # Qwen2.5-0.5B/1.5B logits


def test_teacher_support_bytes_by_hand():
    # Sampled-token log-probs only: rows x tokens x 4 B.
    assert teacher_support_bytes(2, 3, 100, None) == 24
    # Full vocabulary: + rows x tokens x V x 4 B.
    assert teacher_support_bytes(2, 3, 100, 0) == 24 + 2 * 3 * 100 * 4
    assert teacher_support_bytes(2, 3, 100, 100) == teacher_support_bytes(2, 3, 100, 0)  # K >= V is full
    # Top-K: + rows x tokens x (K x (4 B log-prob + 4 B int32 id) + 4 B tail).
    assert teacher_support_bytes(2, 3, 100, 8) == 24 + 2 * 3 * (8 * 8 + 4)


@pytest.mark.parametrize("topk", [4, 0])
def test_the_count_is_what_the_scorer_hands_over(random_model_dir, topk):
    """The bytes of a real TeacherScores (ScorerWorker.score, top-K and full support) are what the refusal counts:
    the ids travel as int32 (an earlier count said int64, twice the ids' bytes)."""
    from miniverl.batches import RolloutBatch
    from miniverl.process import ProcessSettings
    from miniverl.workers.scorer import ScorerWorker

    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = RolloutBatch(
        prompts=torch.tensor([[0, 1, 5, 6], [1, 7, 8, 9]]),
        prompt_mask=torch.ones(2, 4, dtype=torch.long),
        responses=torch.tensor([[10, 11, 2], [12, 2, 0]]),
        response_mask=mask,
        rollout_log_probs=-torch.ones(2, 3) * mask,
        uid=["a", "b"],
        ground_truth=["", ""],
        policy_version=0,
    )
    scorer = ScorerWorker(str(random_model_dir), "float32", 4, ProcessSettings("cpu", torch_threads=1))
    scores = scorer.score(batch, topk, 1.0)
    tensors = [
        scores.teacher_log_probs,
        scores.teacher_topk_logprobs,
        scores.teacher_topk_ids,
        scores.teacher_tail_logprob,
    ]
    handed = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    vocab = scorer.model.config.vocab_size
    assert handed == teacher_support_bytes(2, 3, vocab, topk)


def test_reference_workload_full_support_is_74_gib_and_top64_a_tenth_of_one():
    """64 prompts x 4 samples x 512 tokens at a 152k vocabulary: full support is 74 GiB, top-64 0.06 GiB."""
    full = teacher_support_bytes(256, 512, QWEN_VOCAB, 0)
    assert full / GIB == pytest.approx(256 * 512 * (QWEN_VOCAB + 1) * 4 / GIB)
    assert 74 < full / GIB < 75
    assert teacher_support_bytes(256, 512, QWEN_VOCAB, 64) / GIB == pytest.approx(256 * 512 * (64 * 8 + 4 + 4) / GIB)


def test_learner_logits_bytes_whole_micro_batch_and_chunked():
    assert learner_logits_bytes(16, 512, QWEN_VOCAB, 0) == 16 * 512 * QWEN_VOCAB * 4 * 6  # 27.8 GiB
    assert learner_logits_bytes(16, 512, QWEN_VOCAB, 256) == 256 * QWEN_VOCAB * 4 * 6  # 0.87 GiB
    assert learner_logits_bytes(2, 10, 50, 64) == learner_logits_bytes(2, 10, 50, 0)  # a chunk over the micro-batch
    assert learner_logits_bytes(16, 512, QWEN_VOCAB, 0, max_tokens=1000) == 1000 * QWEN_VOCAB * 4 * 6


def test_full_vocabulary_support_at_qwen_scale_is_refused_with_the_arithmetic():
    with pytest.raises(ConfigError) as err:
        check_vocab_memory(256, 512, QWEN_VOCAB, 0, 16, 64, 4.0)
    msg = str(err.value)
    assert "74.2 GiB: 256 rows x 512 tokens x 151936 x 4 B (full vocabulary)" in msg
    assert "trainer.vocab_memory_budget_gib=4" in msg and "objective.teacher_topk" in msg


def test_unchunked_learner_logits_at_qwen_scale_are_refused_and_chunking_fits():
    with pytest.raises(ConfigError) as err:
        check_vocab_memory(256, 512, QWEN_VOCAB, 64, 16, 0, 4.0)
    msg = str(err.value)
    assert "27.8 GiB at once: 8192 response tokens x 151936 x 24 B of buffers per entry of an LM-head chunk" in msg
    assert "trainer.logprob_chunk_tokens" in msg and "trainer.max_tokens_per_micro_batch" in msg
    check_vocab_memory(256, 512, QWEN_VOCAB, 64, 16, 256, 4.0, max_tokens=16384)  # the gkd_4080 settings fit
    check_vocab_memory(256, 512, QWEN_VOCAB, None, 16, 256, 4.0)  # PG-k1: sampled tokens only


def test_the_closed_form_head_counts_its_bf16_logits_only():
    """1,024-token chunks (the gkd_4080 recipe): 0.6 GB on the closed-form path, 3.7 GB with autograd's fp32
    copies; 2,048 fit only on the closed-form path under a 4 GiB budget."""
    assert learner_logits_bytes(16, 512, QWEN_VOCAB, 1024, closed_form=True) == 1024 * QWEN_VOCAB * 4
    check_vocab_memory(256, 512, QWEN_VOCAB, 64, 16, 2048, 4.0, max_tokens=16384, closed_form=True)
    with pytest.raises(ConfigError, match="x 24 B of buffers per entry"):
        check_vocab_memory(256, 512, QWEN_VOCAB, 64, 16, 2048, 4.0, max_tokens=16384, closed_form=False)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.logprob_chunk_tokens=-1", r"trainer.logprob_chunk_tokens=-1: use 0 \(a micro-batch at once\)"),
        (
            "trainer.max_tokens_per_micro_batch=16",
            r"trainer.max_tokens_per_micro_batch=16: below the longest possible row",
        ),
        ("trainer.vocab_memory_budget_gib=0", r"trainer.vocab_memory_budget_gib=0.0: must be > 0"),
    ],
)
def test_bad_memory_settings_name_the_key(override, message):
    from miniverl.config import validate
    from tests.test_config import load

    with pytest.raises(ConfigError, match=message):
        validate(load(override))


def test_the_memory_report_carries_the_allocators_retries(monkeypatch):
    """Each actor's report: its peaks, and how often the allocator gave its cache back to find room under the cap
    (torch's num_alloc_retries: a device-wide sync each); nothing on the CPU."""
    import torch

    from miniverl.process import memory_report

    assert memory_report("cpu") == {}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": 17})
    assert memory_report("cuda") == {"peak_allocated_gib": 3.0, "peak_reserved_gib": 4.0, "alloc_retries": 17.0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})  # an allocator that keeps no such count
    assert memory_report("cuda")["alloc_retries"] == 0.0


def test_the_memory_history_is_asked_for_by_one_variable(monkeypatch):
    """MINIVERL_CUDA_MEMORY_HISTORY: 1 records, 0 or unset does not, anything else is refused with the fix; off
    CUDA nothing records and the out-of-memory lines carry no sites."""
    from miniverl.process import (
        MEMORY_HISTORY_ENV,
        allocation_sites_note,
        memory_history_requested,
        record_memory_history,
    )

    monkeypatch.delenv(MEMORY_HISTORY_ENV, raising=False)
    assert not memory_history_requested()
    monkeypatch.setenv(MEMORY_HISTORY_ENV, "0")
    assert not memory_history_requested()
    monkeypatch.setenv(MEMORY_HISTORY_ENV, "1")
    assert memory_history_requested()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert record_memory_history() is False
    assert allocation_sites_note() == ""
    monkeypatch.setenv(MEMORY_HISTORY_ENV, "yes")
    with pytest.raises(ConfigError, match="MINIVERL_CUDA_MEMORY_HISTORY='yes': set it to 1"):
        memory_history_requested()


def test_allocation_sites_sum_live_blocks_by_the_projects_innermost_frame():
    """A snapshot's live blocks summed by the innermost frame in miniverl's code (torch's own frames inside it
    skipped), blocks without a stack grouped apart, freed or cached blocks not counted; largest first."""
    from miniverl.process import allocation_sites

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    torch_alloc = frame("/venv/torch/nn/functional.py", 10, "linear")
    prefill = frame("/tmp/tree/miniverl/rollout/hf_cached.py", 180, "_prefill")
    cache = frame("/tmp/tree/miniverl/rollout/decode_cache.py", 40, "allocate")
    outside = frame("/venv/transformers/modeling_utils.py", 99, "load")
    snapshot = {
        "segments": [
            {
                "blocks": [
                    {"size": 300, "state": "active_allocated", "frames": [torch_alloc, prefill, cache]},
                    {"size": 200, "state": "active_allocated", "frames": [prefill]},
                    {"size": 1000, "state": "inactive", "frames": [cache]},  # cached, not allocated
                    {"size": 700, "state": "active_allocated", "frames": [cache]},
                ]
            },
            {
                "blocks": [
                    {"size": 50, "state": "active_allocated", "frames": [outside]},
                    {"size": 80, "state": "active_allocated", "frames": []},
                ]
            },
        ]
    }
    assert allocation_sites(snapshot) == [
        ("miniverl/rollout/decode_cache.py:40 allocate", 700),
        ("miniverl/rollout/hf_cached.py:180 _prefill", 500),
        ("allocated before the history started", 80),
        ("modeling_utils.py:99 load", 50),
    ]
    assert allocation_sites(snapshot, top=1) == [("miniverl/rollout/decode_cache.py:40 allocate", 700)]
    assert allocation_sites({}) == []


def test_the_sites_note_reads_the_snapshot_when_recording(monkeypatch):
    """While a process records its history, the note an out-of-memory line carries lists the sites in GiB."""
    from miniverl import process

    snapshot = {
        "segments": [
            {
                "blocks": [
                    {
                        "size": 3 * 2**29,
                        "state": "active_allocated",
                        "frames": [{"filename": "/x/miniverl/a.py", "line": 7, "name": "f"}],
                    }
                ]
            }
        ]
    }
    monkeypatch.setitem(process._history, "on", True)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: snapshot)
    assert (
        process.allocation_sites_note()
        == "; live GPU blocks by where they were allocated: 1.50 GiB at miniverl/a.py:7 f"
    )
