"""Batch contracts: valid batches construct, every violation raises a BatchError naming the problem."""

from __future__ import annotations

import pytest
import torch

from miniverl.batches import DEFAULT_DATA_SOURCE, PromptBatch, RolloutBatch, TeacherScores, concat_rollouts
from miniverl.errors import BatchError
from miniverl.policy import weights_digest


def make_batch(**overrides) -> RolloutBatch:
    """Two groups of two samples: prompts of 2 and 3 tokens, responses of 3 and 1 tokens."""
    fields = dict(
        prompts=torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]),
        responses=torch.tensor([[4, 5, 2], [6, 2, 0], [2, 0, 0], [9, 9, 9]]),
        response_mask=torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]),
        rollout_log_probs=torch.tensor([[-0.1, -0.2, -0.3], [-1.0, -0.5, 0.0], [-0.2, 0, 0], [-1, -1, -1.0]]),
        uid=["a", "a", "b", "b"],
        ground_truth=["x", "x", "y", "y"],
        policy_version=3,
    )
    fields.update(overrides)
    return RolloutBatch(**fields)


def test_valid_batch_derives_verl_keys():
    b = make_batch()
    assert len(b) == 4
    assert b.input_ids.shape == (4, 6)
    assert b.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 1]
    # positions count real tokens only: the left pad sits at 0 and the first real token too
    assert b.position_ids[0].tolist() == [0, 0, 1, 2, 3, 4]
    assert b.position_ids[2].tolist() == [0, 1, 2, 3, 3, 3]
    assert b.finished.tolist() == [False] * 4


def test_rows_slices_every_field():
    part = make_batch().rows(1, 3)
    assert part.uid == ["a", "b"] and part.responses.shape == (2, 3) and part.policy_version == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prompt_mask": torch.ones(4, 2, dtype=torch.long)}, "prompt_mask"),
        ({"response_mask": torch.ones(4, 2, dtype=torch.long)}, "response_mask"),
        ({"responses": torch.zeros(4, 3)}, "torch.long"),
        ({"rollout_log_probs": torch.zeros(4, 3, dtype=torch.float64)}, "float32"),
        ({"response_mask": torch.tensor([[1, 2, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])}, "0/1"),
        ({"response_mask": torch.tensor([[1, 0, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])}, "right-padded"),
        ({"prompt_mask": torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])}, "left-padded"),
        ({"prompt_mask": torch.tensor([[0, 0, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]])}, "at least one prompt token"),
        ({"uid": ["a", "b", "a", "b"]}, "not adjacent"),
        ({"uid": ["a", "a", "b"]}, "uids"),
        ({"policy_version": -1}, "policy_version"),
        (
            {"rollout_log_probs": torch.tensor([[0.1, -0.2, -0.3], [-1.0, -0.5, 0.0], [-0.2, 0, 0], [-1, -1, -1.0]])},
            "<= 0",
        ),
        (
            {"rollout_log_probs": torch.tensor([[-0.1, -0.2, -0.3], [-1.0, -0.5, -0.7], [-0.2, 0, 0], [-1, -1, -1.0]])},
            "outside response_mask",
        ),
        (
            {
                "rollout_log_probs": torch.tensor(
                    [[float("nan"), -0.2, -0.3], [-1.0, -0.5, 0], [-0.2, 0, 0], [-1, -1, -1.0]]
                )
            },
            "finite",
        ),
    ],
)
def test_invalid_batches_raise(overrides, message):
    with pytest.raises(BatchError, match=message):
        make_batch(**overrides)


def test_data_source_and_extra_info_travel_with_the_rows():
    b = make_batch(data_source=["gsm8k", "gsm8k", "math", "math"], extra_info=[{"i": 0}, {"i": 0}, {"i": 1}, {"i": 1}])
    part = b.rows(1, 3)
    assert part.data_source == ["gsm8k", "math"] and part.extra_info == [{"i": 0}, {"i": 1}]
    both = concat_rollouts([b.rows(0, 2), b.rows(2, 4)])
    assert both.data_source == b.data_source and both.extra_info == b.extra_info
    assert make_batch().data_source == [DEFAULT_DATA_SOURCE] * 4 and make_batch().extra_info == [{}] * 4
    with pytest.raises(BatchError, match="need 4 data_source and extra_info entries, got 3"):
        make_batch(data_source=["a", "a", "b"])
    prompts = PromptBatch([[1], [2]], ["u", "v"], ["x", "y"], ["s1", "s2"], [{"k": 1}, {"k": 2}])
    assert prompts.select([1]).data_source == ["s2"] and prompts.select([1]).extra_info == [{"k": 2}]
    with pytest.raises(BatchError, match="1 data_source and 2 extra_info entries; give one of each per prompt"):
        PromptBatch([[1], [2]], ["u", "v"], ["x", "y"], ["s1"])


def test_prompt_batch_validation():
    PromptBatch([[1, 2]], ["u"], ["a"])
    with pytest.raises(BatchError, match="empty"):
        PromptBatch([], [], [])
    with pytest.raises(BatchError, match="one uid and one answer"):
        PromptBatch([[1]], ["u", "v"], ["a"])
    with pytest.raises(BatchError, match="unique"):
        PromptBatch([[1], [2]], ["u", "u"], ["a", "b"])
    with pytest.raises(BatchError, match="no tokens"):
        PromptBatch([[]], ["u"], ["a"])


def test_teacher_scores_shapes():
    TeacherScores(torch.zeros(2, 3), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(BatchError, match="same"):
        TeacherScores(torch.zeros(2, 3), torch.zeros(2, 3, 4), torch.zeros(2, 3, 5, dtype=torch.long))
    with pytest.raises(BatchError, match="matching"):
        TeacherScores(torch.zeros(2, 3), torch.zeros(2, 4, 4))


def test_weights_digest_sees_every_change():
    w = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2)}
    d = weights_digest(w)
    assert d == weights_digest({k: v.clone() for k, v in w.items()})
    assert d == weights_digest(dict(reversed(list(w.items()))))  # order-free
    bumped = {**w, "b": torch.tensor([1.0, 1.0 + 1e-7])}
    assert weights_digest(bumped) != d
    assert weights_digest({**w, "b": w["b"].double()}) != d  # dtype is part of the identity
    assert weights_digest({"c": w["a"], "b": w["b"]}) != d  # so are names


def test_token_ids_travel_as_int32_and_arrive_as_long():
    """Issue 16 (data moves once, ids as int32): what Ray ships between processes (its cloudpickle) carries
    int32 ids and bool masks, and the receiver gets back exactly the long tensors the models index with."""
    import pickle

    from ray import cloudpickle

    big = 151_935  # ids far above the int8/int16 ranges, as a real vocabulary's are (Qwen2.5's last id)
    b = make_batch(responses=torch.tensor([[4, big, 2], [6, 2, 0], [2, 0, 0], [big - 1, 9, 70_000]]))
    for dumps in (pickle.dumps, cloudpickle.dumps):
        got = pickle.loads(dumps(b))
        for name in ("prompts", "responses", "prompt_mask", "response_mask"):
            assert getattr(got, name).dtype == torch.long
            assert torch.equal(getattr(got, name), getattr(b, name))
        assert (got.uid, got.policy_version, got.data_source) == (b.uid, b.policy_version, b.data_source)
        assert torch.equal(got.rollout_log_probs, b.rollout_log_probs) and torch.equal(got.finished, b.finished)
    state = b.__getstate__()
    assert state["prompts"].dtype == state["responses"].dtype == torch.int32
    assert state["prompt_mask"].dtype == state["response_mask"].dtype == torch.bool
    assert b.responses.dtype == torch.long  # the batch itself is untouched

    rows, tp, tr = 64, 256, 512  # at real widths the ids and masks are most of the bytes
    wide = make_batch(
        prompts=torch.randint(0, big, (rows, tp)),
        prompt_mask=torch.ones(rows, tp, dtype=torch.long),
        responses=torch.randint(0, big, (rows, tr)),
        response_mask=torch.ones(rows, tr, dtype=torch.long),
        rollout_log_probs=-torch.rand(rows, tr),
        uid=[f"u{i // 4}" for i in range(rows)],
        ground_truth=[""] * rows,
    )
    as_long = sum(getattr(wide, k).numel() * 8 for k in ("prompts", "responses", "prompt_mask", "response_mask"))
    shipped = len(cloudpickle.dumps(wide))
    assert shipped < 0.45 * (as_long + rows * tr * 4)  # 5 of 16 bytes per token, plus the fp32 log-probs
