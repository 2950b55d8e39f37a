"""One seed scheme (miniverl/seeds.py): no two (rollout.seed, purpose, step) share a sampling seed."""

from __future__ import annotations

import pytest

from miniverl.errors import ConfigError
from miniverl.rollout.sampling import row_seeds
from miniverl.seeds import MAX_BASE_SEED, PURPOSES, STEP_STRIDE, sampling_seed


def test_no_collisions_across_purposes_steps_and_rollout_seeds():
    """main: the evaluation sample used rollout.seed + 17 (= training step 17's seed at rollout.seed 0)
    and the gate 7919 (= step 7919's)."""
    seeds = {
        (base, purpose, step): sampling_seed(base, purpose, step)
        for base in (0, 1, 2, MAX_BASE_SEED - 1)
        for purpose in PURPOSES
        for step in (0, 1, 17, 7919, STEP_STRIDE - 1)
    }
    assert len(set(seeds.values())) == len(seeds)
    assert sampling_seed(0, "eval", 0) != sampling_seed(0, "train", 17)
    assert sampling_seed(0, "gate", 0) != sampling_seed(0, "train", 7919)
    assert sampling_seed(3, "train", 5) == 3 * 100_003 + 5  # training keeps its seeds (and its numbers)


def test_row_seeds_of_different_calls_never_meet():
    a = row_seeds(sampling_seed(MAX_BASE_SEED - 1, "gate", STEP_STRIDE - 1), 1000)
    b = row_seeds(sampling_seed(0, "train", 0), 1000)
    assert len(set(a) | set(b)) == 2000 and max(a) < 2**63 - 1


def test_out_of_range_inputs_say_which_setting():
    with pytest.raises(ValueError, match="unknown seed purpose 'test'"):
        sampling_seed(0, "test", 0)
    with pytest.raises(ValueError, match=r"rollout.seed=-1: must be in \[0, "):
        sampling_seed(-1, "train", 0)
    with pytest.raises(ValueError, match="lower trainer.total_steps"):
        sampling_seed(0, "train", STEP_STRIDE)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.total_steps=100003", "trainer.total_steps=100003: sampling seeds"),
        ("rollout.seed=-2", "rollout.seed=-2"),
    ],
)
def test_config_validation_refuses_seeds_that_would_collide(override, message):
    from miniverl.config import validate
    from tests.test_config import load

    with pytest.raises(ConfigError, match=message):
        validate(load(override))


def test_training_prompts_never_draw_the_evaluation_stream(student_dir):
    """Built-in prompts drew step s from data.seed * 7919 + s and the evaluation from data.seed + 1,000,000: with
    data.seed=126, training step 2,332 drew the evaluation prompts (issue 33). Now each draw hashes (seed, purpose,
    step); the bridge's export draws the same streams."""
    from transformers import AutoTokenizer

    from miniverl.bridge.data import task_eval_rows, task_rows
    from miniverl.data.prompts import PromptSource

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    source = PromptSource("reverse", 2, 6, tok, 32, seed=126)
    held_out = source.eval_batch(16)
    assert source.batch(2332, 16).ground_truth != held_out.ground_truth
    firsts = {tuple(source.batch(step, 4).ground_truth) for step in range(300)}
    assert len(firsts) == 300  # 300 steps, 300 different draws
    rows = task_rows("reverse", 2, 6, 126, 3, 4)
    assert [r["reward_model"]["ground_truth"] for r in rows[8:]] == source.batch(2, 4).ground_truth
    assert [
        r["reward_model"]["ground_truth"] for r in task_eval_rows("reverse", 2, 6, 126, 16)
    ] == held_out.ground_truth


def test_training_never_draws_a_held_out_prompt_by_content(student_dir):
    """Different streams can still draw the same text: reverse prompts of 2-3 characters repeat within a few hundred
    draws. With the held-out count given (data.eval_prompts), a training draw whose prompt is an evaluation prompt is
    drawn again; the bridge's export draws the same rows."""
    from transformers import AutoTokenizer

    from miniverl.bridge.data import task_rows
    from miniverl.data.prompts import PromptSource

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    held_out = {p for p in PromptSource("reverse", 2, 3, tok, 32, seed=4).eval_batch(32).ground_truth}

    def trained(source) -> set[str]:
        return {answer for step in range(200) for answer in source.batch(step, 8).ground_truth}

    assert trained(PromptSource("reverse", 2, 3, tok, 32, seed=4)) & held_out  # without it: they meet
    source = PromptSource("reverse", 2, 3, tok, 32, seed=4, held_out=32)
    assert not trained(source) & held_out
    rows = task_rows("reverse", 2, 3, 4, 3, 8, held_out=32)
    assert [r["reward_model"]["ground_truth"] for r in rows[16:]] == source.batch(2, 8).ground_truth


def test_a_held_out_set_that_covers_the_task_is_refused_with_the_fix(student_dir):
    from transformers import AutoTokenizer

    from miniverl.data.prompts import PromptSource

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    source = PromptSource("reverse", 1, 1, tok, 32, seed=0, held_out=400)  # every one-character prompt held out
    with pytest.raises(ConfigError, match=r"drew only held-out prompts .* raise data.max_len or lower data.eval_pro"):
        source.batch(0, 4)
