"""Scale-out on the CPU: sharding over replicas, Ray placement on logical GPUs, gloo data parallelism."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from miniverl.batches import PromptBatch, concat_rollouts, group_bounds
from miniverl.errors import ConfigError
from miniverl.models.lora import LoraSettings
from miniverl.objectives.gkd import GkdObjective
from miniverl.process import ProcessSettings
from miniverl.rewards import ExactMatchReward
from miniverl.rollout.sampling import SamplingParams
from miniverl.setup.placement import plan_placement
from miniverl.step.controller import StrictSyncController, combine_rank_metrics
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from tests.ray_local import init_local_ray
from tests.test_batch_contracts import make_batch

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0)
CPU = ProcessSettings("cpu", torch_threads=1)  # see conftest: one thread for tiny models


def test_group_bounds_never_cut_a_group():
    uid = ["a", "a", "b", "b", "c", "c"]
    assert group_bounds(uid, 1) == [(0, 6)]
    assert group_bounds(uid, 2) == [(0, 4), (4, 6)]
    assert group_bounds(uid, 3) == [(0, 2), (2, 4), (4, 6)]
    assert group_bounds(uid, 4) == [(0, 2), (2, 4), (4, 6), (6, 6)]  # more parts than groups: empty tail


def test_concat_rollouts_repads_both_sides():
    full = make_batch()
    joined = concat_rollouts([full.rows(0, 2), full.rows(2, 4)])
    assert torch.equal(joined.responses, full.responses) and joined.uid == full.uid
    narrow = full.rows(2, 3)  # a replica whose prompts and responses are shorter
    narrow = concat_rollouts([narrow])
    short = type(full)(
        prompts=narrow.prompts[:, 1:],
        prompt_mask=narrow.prompt_mask[:, 1:],
        responses=narrow.responses[:, :1],
        response_mask=narrow.response_mask[:, :1],
        rollout_log_probs=narrow.rollout_log_probs[:, :1],
        uid=["z"],
        ground_truth=["y"],
        policy_version=3,
    )
    joined = concat_rollouts([full.rows(0, 2), short])
    assert joined.prompts.shape == (3, 3) and joined.prompt_mask[2].tolist() == [0, 1, 1]
    assert joined.responses.shape == (3, 3) and joined.response_mask[2].tolist() == [1, 0, 0]


def test_combine_rank_metrics():
    ranks = [
        {"loss": 0.5, "grad_norm": 2.0, "sampler_gap_max": 0.1, "response_tokens": 10, "time/update/gradients": 2.0},
        {"loss": 0.25, "grad_norm": 2.0, "sampler_gap_max": 0.3, "response_tokens": 10, "time/update/gradients": 3.0},
    ]
    assert combine_rank_metrics(ranks) == {
        "loss": 0.75,
        "grad_norm": 2.0,
        "sampler_gap_max": 0.3,
        "response_tokens": 10,
        "time/update/gradients": 3.0,  # the slowest rank's part, not a sum of the ranks' seconds
    }


def test_replicas_sample_what_one_engine_samples(student_dir, teacher_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    texts = ["abc>", "de>", "fgh>", "ij>", "k>"]
    prompts = PromptBatch([tok(t)["input_ids"] for t in texts], [f"p{i}" for i in range(5)], ["x"] * 5)
    learner = LearnerWorker(str(student_dir), LORA, "float32", GkdObjective(0.5, 1.0, 0), 1e-3, 0.0, 1.0, 4, CPU)
    scorer = ScorerWorker(str(teacher_dir), "float32", 4, CPU)
    engines = [RolloutWorker("hf_reference", str(student_dir), LORA, "float32", CPU) for _ in range(3)]
    params = SamplingParams(n=2, max_new_tokens=5, stop_token_ids=(tok.eos_token_id,), seed=11)
    reward = ExactMatchReward(tok)
    one = StrictSyncController(engines[0], scorer, learner, reward, 0, 1.0)
    three = StrictSyncController(engines, [scorer, scorer], learner, reward, 0, 1.0)
    identity = three.ensure_served()
    assert all(e.served == identity for e in engines)  # every replica serves the published policy
    a, b = one.sample(prompts, params, identity), three.sample(prompts, params, identity)
    assert b.uid == a.uid
    assert torch.equal(a.responses, b.responses) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.rollout_log_probs, b.rollout_log_probs, atol=1e-5, rtol=0)
    sa, sb = one.fetch_scores(one.score(a, 0)), three.fetch_scores(three.score(b, 0))
    torch.testing.assert_close(sa.teacher_log_probs, sb.teacher_log_probs, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_two_logical_gpus_train_like_one(tmp_path, student_dir, teacher_dir):
    """Placement groups on Ray's logical GPUs, 2 rollout/scorer replicas and 2 gloo learner ranks:
    the adapter after two steps matches the one-replica run."""
    import ray
    from safetensors.torch import load_file

    from miniverl.main import train
    from tests.test_config import with_models

    init_local_ray(num_cpus=4, num_gpus=2)
    try:
        results = {}
        for gpus, scorer_gpus in ((1, 0), (2, 0), (1, 1)):
            cfg = with_models(
                student_dir,
                teacher_dir,
                "resources.device=cpu",
                f"resources.gpus={gpus}",
                "data.prompts_per_step=4",
                "data.eval_prompts=4",
                "rollout.max_new_tokens=5",
                "trainer.eval_every=0",
                "tracking=disabled",
                "tracking.progress_bar=false",
                "resources.rollout.num_cpus=0.25",
                "resources.scorer.num_cpus=0.25",
                "resources.learner.num_cpus=0.25",
                "model.lora.rank=4",
                f"resources.scorer_gpus={scorer_gpus}",
            )
            run_dir = tmp_path / f"gpus{gpus}-{scorer_gpus}"
            run_dir.mkdir()
            summary = train(cfg, run_dir, {}, log=lambda *_: None)
            assert summary["steps"] == 2
            results[gpus, scorer_gpus] = load_file(
                str(Path(summary["checkpoint"]) / "adapter/adapter_model.safetensors")
            )
        one, two, dedicated = results[1, 0], results[2, 0], results[1, 1]
        assert one.keys() == two.keys() == dedicated.keys()
        for k in one:
            torch.testing.assert_close(two[k], one[k], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(dedicated[k], one[k], atol=1e-6, rtol=1e-5)  # same math, another process
        for _ in range(50):  # placement groups are released asynchronously
            if ray.available_resources().get("GPU", 0) == 2:
                break
            time.sleep(0.2)
        assert ray.available_resources().get("GPU", 0) == 2
    finally:
        ray.shutdown()


def _resources(*overrides: str):
    from tests.test_config import load

    return load(*overrides).resources


def test_placement_without_gpus_is_one_replica_each():
    plan = plan_placement(_resources(), 0)
    assert plan.count == {"rollout": 1, "scorer": 1, "learner": 1}
    assert plan.bundle_cpus == [] and set(plan.num_gpus.values()) == {0.0}


def test_placement_repeats_the_one_gpu_layout():
    plan = plan_placement(_resources(), 2)
    assert plan.count == {"rollout": 2, "scorer": 2, "learner": 2}
    assert plan.num_gpus == {"rollout": 0.4, "scorer": 0.3, "learner": 0.3}
    assert plan.bundle == {"rollout": [0, 1], "scorer": [0, 1], "learner": [0, 1]}
    assert plan.bundle_cpus == [1.5, 1.5]
    assert plan.totals()["rollout"] == {"CPU": 1.0, "GPU": 0.8}


def test_placement_with_dedicated_scorer_gpus():
    plan = plan_placement(_resources("resources.scorer_gpus=1", "resources.learner.num_gpus=0.6"), 2)
    assert plan.count == {"rollout": 2, "scorer": 1, "learner": 2}
    assert plan.num_gpus["scorer"] == 1.0
    assert plan.bundle == {"rollout": [0, 1], "scorer": [2], "learner": [0, 1]}
    assert plan.bundle_cpus == [1.0, 1.0, 0.5]


def test_placement_refuses_an_overfull_gpu():
    with pytest.raises(ConfigError, match="must sum to at most 1"):
        plan_placement(_resources("resources.learner.num_gpus=0.5"), 1)


def test_actors_take_half_the_cores_unless_told():
    """0 (the default): half the cores, at least one, strict or stale (all-core pools made a stale step 4.5x slower
    on 2 cores, and a strict one 2.2x slower beside other work); explicit counts are kept."""
    from miniverl.cluster.launch import actor_threads

    assert actor_threads(0, 2) == 1 and actor_threads(0, 16) == 8 and actor_threads(0, 1) == 1
    assert actor_threads(3, 2) == 3 and actor_threads(1, 16) == 1
