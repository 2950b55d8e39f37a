"""Batches as safetensors + JSON manifest under verl's key names: round trip, manifest, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from miniverl.batches import RolloutBatch, TeacherScores
from miniverl.bridge import batches
from miniverl.bridge.versions import miniverl_version
from miniverl.errors import BatchError, ConfigError

B, TP, TR, K = 4, 3, 5, 2


def make_batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    lp = -torch.rand(B, TR, generator=g) * response_mask
    return RolloutBatch(
        prompts=torch.randint(1, 9, (B, TP), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        responses=torch.randint(1, 9, (B, TR), generator=g) * response_mask,
        response_mask=response_mask,
        rollout_log_probs=lp.float(),
        uid=["a", "a", "b", "b"],
        ground_truth=["x", "x", "y", "y"],
        policy_version=7,
        finished=torch.tensor([True, False, True, True]),
    )


def make_scores(topk: bool) -> TeacherScores:
    g = torch.Generator().manual_seed(1)
    sampled = -torch.rand(B, TR, generator=g)
    if not topk:
        return TeacherScores(sampled)
    return TeacherScores(
        sampled,
        -torch.rand(B, TR, K, generator=g),
        torch.randint(0, 9, (B, TR, K), generator=g),
        -torch.rand(B, TR, generator=g),
        loss_temperature=1.5,
    )


@pytest.mark.parametrize("topk", [True, False])
def test_round_trip(tmp_path, topk):
    batch, scores = make_batch(), make_scores(topk)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    cols = {"advantages": torch.randn(B, TR), "ref_log_prob": -torch.rand(B, TR)}
    batches.save_batch(tmp_path / "b", batch, scores, rewards, cols)
    back = batches.load_batch(tmp_path / "b")
    for name in ("prompts", "prompt_mask", "responses", "response_mask", "rollout_log_probs", "finished"):
        assert torch.equal(getattr(back.rollout, name), getattr(batch, name)), name
    assert (back.rollout.uid, back.rollout.ground_truth, back.rollout.policy_version) == (
        batch.uid,
        batch.ground_truth,
        7,
    )
    assert torch.equal(back.scores.teacher_log_probs, scores.teacher_log_probs)
    for name in ("teacher_topk_logprobs", "teacher_topk_ids", "teacher_tail_logprob"):
        a, b = getattr(back.scores, name), getattr(scores, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert back.scores.loss_temperature == scores.loss_temperature
    assert torch.equal(back.rewards, rewards)
    assert set(back.columns) == set(cols) and all(torch.equal(back.columns[k], cols[k]) for k in cols)


def test_verl_keys_and_padding(tmp_path):
    batch = make_batch()
    batches.save_batch(tmp_path / "b", batch, make_scores(False), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    t, manifest = batches.load_tensors(tmp_path / "b")
    assert torch.equal(t["input_ids"], torch.cat([batch.prompts, batch.responses], 1))
    assert torch.equal(t["attention_mask"][:, :TP], batch.prompt_mask)  # left-padded prompts
    assert t["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4, 4, 4]  # counts real tokens only
    assert t["teacher_logprobs"].shape == (B, TR, 1)
    # the reward sits on the last response token
    assert t["token_level_scores"][0].tolist() == [0, 0, 1.0, 0, 0]
    assert t["token_level_scores"][1].tolist() == [0, 0, 0, 0, 2.0]
    assert t["token_level_scores"][2].tolist() == [3.0, 0, 0, 0, 0]
    assert manifest["policy_version"] == 7 and manifest["miniverl_version"] == miniverl_version()
    assert manifest["verl_version"] == "0.9.1" and manifest["padding"] == {"prompts": "left", "responses": "right"}
    assert manifest["tensors"]["responses"] == {"dtype": "int64", "shape": [B, TR]}
    assert manifest["non_tensors"]["uid"] == batch.uid
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["batch.safetensors", "manifest.json"]


def _edit_manifest(path, **changes):
    file = path / batches.MANIFEST_FILE
    m = json.loads(file.read_text())
    for key, value in changes.items():
        m[key] = value
    file.write_text(json.dumps(m))
    return m


def test_other_major_version_refused(tmp_path):
    batches.save_batch(tmp_path / "b", make_batch())
    other = str(int(miniverl_version().split(".")[0]) + 1) + ".0.0"
    _edit_manifest(tmp_path / "b", miniverl_version=other)
    with pytest.raises(BatchError, match=f"written by miniverl {other}"):
        batches.load_batch(tmp_path / "b")


def test_manifest_must_match_the_tensors(tmp_path):
    batches.save_batch(tmp_path / "b", make_batch())
    m = json.loads((tmp_path / "b" / batches.MANIFEST_FILE).read_text())
    m["tensors"]["responses"]["shape"] = [B, TR + 1]
    (tmp_path / "b" / batches.MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(BatchError, match="tensor responses is"):
        batches.load_tensors(tmp_path / "b")
    with pytest.raises(BatchError, match="no manifest.json"):
        batches.load_tensors(tmp_path)


def test_existing_directory_never_overwritten(tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists"):
        batches.save_batch(out, make_batch())
    assert (out / "keep.txt").read_text() == "mine"


def test_bad_columns_refused_and_nothing_written(tmp_path):
    with pytest.raises(BatchError, match="unknown batch column"):
        batches.save_batch(tmp_path / "b", make_batch(), columns={"values": torch.zeros(B, TR)})
    with pytest.raises(BatchError, match="rewards must be"):
        batches.save_batch(tmp_path / "b", make_batch(), rewards=torch.zeros(B + 1))
    assert list(tmp_path.iterdir()) == []


def test_to_dataproto_without_verl_says_where_to_run_it(tmp_path):
    import importlib.util

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is importable in this environment; test_verl_backed covers to_dataproto")
    batches.save_batch(tmp_path / "b", make_batch())
    with pytest.raises(ImportError, match="make_verl_venv.sh"):
        batches.to_dataproto(tmp_path / "b")
