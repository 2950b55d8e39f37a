"""Rewards: the text scorers, routing by data_source, and a user's function (including bad ones)."""

from __future__ import annotations

import pytest
import torch

from miniverl.batches import RolloutBatch
from miniverl.config import RewardConfig
from miniverl.errors import ConfigError
from miniverl.rewards import RewardError, build_reward, check_reward_config
from miniverl.rewards.scoring import boxed, exact_match, gsm8k, last_boxed, to_number


class CharTok:
    """Decodes ids as chr(id): enough to put known text in a RolloutBatch."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def batch(texts, truths, sources, finished=None, extra=None) -> RolloutBatch:
    b, tr = len(texts), max(1, max(map(len, texts)))
    responses = torch.zeros((b, tr), dtype=torch.long)
    mask = torch.zeros((b, tr), dtype=torch.long)
    for i, t in enumerate(texts):
        responses[i, : len(t)] = torch.tensor([ord(c) for c in t], dtype=torch.long)
        mask[i, : len(t)] = 1
    return RolloutBatch(
        prompts=torch.ones((b, 1), dtype=torch.long),
        prompt_mask=torch.ones((b, 1), dtype=torch.long),
        responses=responses,
        response_mask=mask,
        rollout_log_probs=torch.zeros((b, tr)),
        uid=[f"u{i}" for i in range(b)],
        ground_truth=list(truths),
        policy_version=0,
        finished=torch.tensor(finished if finished is not None else [True] * b),
        data_source=list(sources),
        extra_info=extra,
    )


@pytest.mark.parametrize(
    ("fn", "response", "truth", "score"),
    [
        (exact_match, "cba", "cba", 1.0),
        (exact_match, "cba ", "cba", 0.0),
        (gsm8k, "48 / 2 = 24, 48 + 24 = 72\n#### 72", "72", 1.0),
        (gsm8k, "#### 1,234", "1234", 1.0),
        (gsm8k, "#### 7 then #### 8", "7", 0.0),  # the last answer counts
        (gsm8k, "the answer is 72", "72", 0.0),  # no #### marker
        (gsm8k, "#### 72", "Natalia sold 48/2 = 24.\n#### 72", 1.0),  # raw GSM8K solution as ground truth
        (boxed, r"so \boxed{\frac{3}{4}}", "0.75", 1.0),
        (boxed, r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
        (boxed, r"\boxed{1,000}", "1000", 1.0),
        (boxed, r"\boxed{50\%}", "50", 1.0),
        (boxed, r"\boxed{x + 1}", "x+1", 1.0),
        (boxed, r"\boxed{\text{(A)}}", "(A)", 1.0),
        (boxed, r"\boxed{2} then \boxed{3}", "2", 0.0),
        (boxed, r"\boxed{3", "3", 0.0),  # cut off before the brace closed
        (boxed, "3", "3", 0.0),  # no box
    ],
)
def test_text_scorers(fn, response, truth, score):
    assert fn(response, truth) == score


def test_boxed_parsing_and_numbers():
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert last_boxed(r"$\boxed 5$") == "5"
    assert to_number("1,2") is None and to_number("-3.5") == -3.5 and to_number(r"-\frac{1}{4}") == -0.25


def test_auto_routes_each_row_by_data_source():
    reward = build_reward(RewardConfig(), CharTok())
    rows = batch(
        ["#### 4", r"\boxed{4}", "dcba", "#### 4"],
        ["4", "4", "dcba", "5"],
        ["openai/gsm8k", "lighteval/MATH", "reverse", "openai/gsm8k"],
    )
    assert reward(rows).tolist() == [1.0, 1.0, 1.0, 0.0]
    # gsm8k's scorer on a boxed answer would score 0: the routing, not luck, gives row 1 its point
    assert gsm8k(r"\boxed{4}", "4") == 0.0


def test_unfinished_rows_score_zero():
    reward = build_reward(RewardConfig(name="exact_match"), CharTok())
    assert reward(batch(["ab", "ab"], ["ab", "ab"], ["x", "x"], finished=[True, False])).tolist() == [1.0, 0.0]


def test_unknown_source_says_how_to_choose_a_reward():
    reward = build_reward(RewardConfig(), CharTok())
    with pytest.raises(RewardError, match=r"no reward for data_source 'mine'.*reward.name=.*by_source"):
        reward.check_sources(["reverse", "mine"])
    by_source = build_reward(RewardConfig(by_source={"mine": "gsm8k"}), CharTok())
    assert by_source(batch(["#### 3"], ["3"], ["mine"])).tolist() == [1.0]


def test_bad_reward_names():
    with pytest.raises(ConfigError, match="unknown reward 'fuzzy'"):
        check_reward_config(RewardConfig(name="fuzzy"))
    with pytest.raises(ConfigError, match=r"reward.by_source.mine='fuzzy' is not a reward"):
        check_reward_config(RewardConfig(by_source={"mine": "fuzzy"}))


def write_fn(tmp_path, body: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return f"{path}:score"


def test_custom_function_gets_verl_arguments(tmp_path):
    spec = write_fn(
        tmp_path,
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.strip() == ground_truth) + extra_info['bonus']}\n",
    )
    reward = build_reward(RewardConfig(custom_function=spec), CharTok())
    out = reward(batch([" 7", "8"], ["7", "7"], ["a", "b"], extra=[{"bonus": 0.5}, {"bonus": 0.0}]))
    assert out.tolist() == [1.5, 0.0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "def score(*a):\n    if a[1] == 'y':\n        raise KeyError('answer')\n    return 1.0\n",
            r"row 1 \(uid u1, data_source 'b'\), reward .*my_reward.py:score raised KeyError",
        ),
        (
            "def score(*a):\n    return 'yes' if a[1] == 'y' else 1.0\n",
            r"row 1 .* returned 'yes'; a reward must return a finite number",
        ),
        ("def score(*a):\n    return float('nan') if a[1] == 'y' else 1.0\n", "returned nan"),
    ],
)
def test_a_bad_row_stops_naming_the_row_and_the_function(tmp_path, body, message):
    reward = build_reward(RewardConfig(custom_function=write_fn(tmp_path, body)), CharTok())
    with pytest.raises(RewardError, match=message):
        reward(batch(["x", "y"], ["1", "1"], ["a", "b"]))


@pytest.mark.parametrize(
    ("spec", "body", "message"),
    [
        ("{dir}/my_reward.py", "", "write it as path/to/file.py:function_name"),
        ("{dir}/nope.py:score", "", "nope.py does not exist"),
        ("{dir}/my_reward.py:score", "def other(*a):\n    return 1\n", "defines no function 'score' .*other"),
        ("{dir}/my_reward.py:score", "import not_a_module\n", "importing .* raised ModuleNotFoundError"),
    ],
)
def test_bad_custom_function_specs(tmp_path, spec, body, message):
    (tmp_path / "my_reward.py").write_text(body)
    with pytest.raises(ConfigError, match=message):
        build_reward(RewardConfig(custom_function=spec.format(dir=tmp_path)), CharTok())


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("27 + 82 = 109", "109", 1.0),  # SmolLM2's worked form: the last number answers
        ("The answer is 109.", "109", 1.0),
        ("The total is 1,234 apples", "1234", 1.0),  # thousands separators
        ("x = -2", "-2", 1.0),
        ("5-3=2", "2", 1.0),  # a binary minus is not a sign
        ("3.50", "3.5", 1.0),
        ("#### 12. Check: 3 + 9", "12", 1.0),  # a marked answer wins over later numbers
        ("so \\boxed{-5}, not 7", "-5", 1.0),
        ("To add 67 and 70, we need to", "137", 0.0),  # cut off before the answer
        ("", "1", 0.0),
        ("no number here", "3", 0.0),
        ("109", "one hundred and nine", 0.0),  # a ground truth that is no number scores nothing
        ("#### \\boxed{}", "0", 0.0),  # empty markers, no number
        ("27 + 82 = 110", "109", 0.0),
    ],
)
def test_numeric_reward_reads_the_final_number(response, truth, score):
    from miniverl.rewards.scoring import numeric

    assert numeric(response, truth) == score


def test_numeric_is_the_chat_tasks_reward_and_a_name():
    from miniverl.rewards import REWARDS, SOURCE_REWARDS

    assert SOURCE_REWARDS["addition_chat"] == "numeric" and SOURCE_REWARDS["addition"] == "exact_match"
    check_reward_config(RewardConfig(name="numeric"))
    fn = build_reward(RewardConfig(name="numeric"), CharTok())
    assert fn(batch(["1 + 2 = 3", "1 + 2 = 4"], ["3", "3"], ["jsonl", "jsonl"])).tolist() == [1.0, 0.0]
    assert "numeric" in REWARDS.names()
