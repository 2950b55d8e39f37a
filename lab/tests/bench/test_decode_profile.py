"""The decode profile (lab/bench/decode_profile.py) on the CPU at a tiny shape: the cells, the lengths its stop
tokens give, and the files it writes (the GPU-only parts, the kernel trace and graph replays, are empty here)."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
import torch

from lab.bench import decode_profile
from lab.bench.oracle import sampled_logprobs, stop_mass
from miniverl.rollout import Completion


def test_the_stop_set_gives_the_asked_median():
    assert decode_profile.stop_set(0, 1000, 7) == ()
    stops = decode_profile.stop_set(150, 151936, 7)
    assert len(stops) == round(math.log(2) * 151936 / 150) == len(set(stops))
    assert stops == decode_profile.stop_set(150, 151936, 7)  # seeded


def test_a_tiny_profile_runs_on_the_cpu_and_writes_its_cells(tmp_path):
    result = decode_profile.run(profile_args(tmp_path))
    written = json.loads((tmp_path / "decode_profile.json").read_text())
    assert [c["cell"] for c in written["cells"]] == ["4x2x24", "2x1x8"] == [c["cell"] for c in result["cells"]]
    first = written["cells"][0]
    lengths = first["generate"]["lengths"]
    assert 1 <= lengths["min"] <= lengths["median"] <= lengths["max"] <= 24
    assert lengths["mean"] < 24  # the stop tokens ended rows early
    assert first["generate"]["tokens"] == round(lengths["mean"] * 8)
    assert first["trace"]["steps"] == 8 and first["replay_ms"] == {}  # no CUDA graphs on the CPU
    assert first["replay_by_column"] == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_replays_by_column_stay_inside_the_cache_and_a_later_column_costs_no_less(tmp_path):
    result = decode_profile.run(profile_args(tmp_path, cells="4x2x160", stop_median=0, profile_steps=16))
    cell = result["cells"][0]
    by_column = {int(c): ms for c, ms in cell["replay_by_column"].items()}
    assert len(by_column) == 3 and all(ms > 0 for ms in by_column.values())
    first, *_, last = sorted(by_column)
    assert 9 < first < last <= 9 + 160 - 50  # from an eighth of the way on, iters short of the call's last column
    assert by_column[last] >= 0.9 * by_column[first]


def profile_args(tmp_path, **changes) -> argparse.Namespace:
    args = dict(
        out=str(tmp_path), backend="hf_cached", backend_args="{}", shape="tiny", cells="4x2x24,2x1x8",
        prompt_len="3:9", stop_median=6, profile_steps=8, repeats=1, oracle_rows=0, prefill_tokens=None,
    )  # fmt: skip
    return argparse.Namespace(**(args | changes))


def test_the_prefill_pass_is_set_for_the_run_and_recorded(tmp_path, monkeypatch):
    """`--prefill-tokens` (hf_cached's passes, to measure another size against the default in one sitting): the same
    rows at 9 padded tokens a pass (one prompt) as at the default, and the size in the results."""
    from miniverl.rollout import hf_cached

    monkeypatch.setattr(hf_cached, "PREFILL_TOKENS", hf_cached.PREFILL_TOKENS)  # restored after the test
    default = decode_profile.run(profile_args(tmp_path / "a", profile_steps=0))
    one = decode_profile.run(profile_args(tmp_path / "b", profile_steps=0, prefill_tokens=9))
    assert hf_cached.PREFILL_TOKENS == 9 and one["prefill_tokens"] == 9 and default["prefill_tokens"] is None
    assert [c["generate"]["lengths"] for c in one["cells"]] == [c["generate"]["lengths"] for c in default["cells"]]


def test_a_bench_peer_runs_the_same_cells_and_an_untraced_cell_has_no_trace(tmp_path):
    """`--backend hf_generate` (a peer from lab/bench/baselines.py) with `--profile-steps 0`: timed, not traced."""
    result = decode_profile.run(profile_args(tmp_path, backend="hf_generate", stop_median=0, profile_steps=0))
    cell = result["cells"][0]
    assert cell["cell"] == "4x2x24" and "trace" not in cell
    assert cell["generate"]["tokens"] == 4 * 2 * 24  # model.generate runs every row to the cap (equal work)
    assert "4x2x24:" in decode_profile.summary_line(cell) and "trace" not in decode_profile.summary_line(cell)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"backend": "tgi"}, "'tgi' is not a rollout backend or a bench peer; choose one of"),
        ({"backend_args": "{logprobs: false}"}, "--backend-args is not JSON"),
        ({"backend_args": "[1]"}, "--backend-args must be a JSON object"),
        ({"backend": "hf_generate", "backend_args": '{"logprobs": false}'}, "--backend-args do not fit hf_generate"),
        ({"backend": "sglang", "backend_args": '{"gpu_share": 2}'}, "--backend-args do not fit sglang: the bench's"),
        ({"prefill_tokens": 0}, "--prefill-tokens is hf_cached's and at least 1, got 0"),
        ({"backend": "hf_generate", "prefill_tokens": 64}, "got 64 for hf_generate"),
    ],
)
def test_a_wrong_backend_or_argument_names_the_fix_before_any_cell_runs(tmp_path, changes, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        decode_profile.run(profile_args(tmp_path, **changes))
    assert not (tmp_path / "decode_profile.json").exists()


def test_the_oracle_judges_a_backends_rows_by_the_law_they_were_sampled_from(tmp_path):
    """`--oracle-rows`: hf_cached's own log-probs agree with the oracle's (fp32 on the CPU), the stop hazard is
    stops per token; rows whose reported log-probs are off by one nat read a gap of one."""
    result = decode_profile.run(profile_args(tmp_path, profile_steps=0, oracle_rows=3))
    cell = result["cells"][0]
    ora, gen = cell["oracle"], cell["generate"]
    assert ora["rows"] == 4 and 0 < ora["tokens"] <= 4 * 24  # whole groups of n = 2: 3 rows round up to 4
    assert ora["gap_mean"] < 1e-4 and ora["logprob_mean"] < 0
    assert 0 < gen["stop_hazard"] <= 1 and "stop hazard" in decode_profile.summary_line(cell)
    assert 0 < gen["distinct_rows"] <= 1
    assert ora["stop_hazard"] > 0 and 0 < ora["stop_mass_mean"] < 1
    assert "vs the law's" in decode_profile.summary_line(cell)

    oracle = decode_profile.build_oracle(_tiny_model(tmp_path), decode_profile.ADAPTER, torch.float32, "cpu")
    prompts, rows = [[1, 2, 3], [4, 5]], [Completion([7, 8, 9], [], True) for _ in range(4)]
    silent = decode_profile.judge_rows(oracle, prompts, 2, rows, 4)  # a peer without log-probs: no gap
    assert "gap_mean" not in silent and silent["tokens"] == 12
    own = sampled_logprobs(oracle, prompts, 2, rows)[0].view(4, 3)
    shifted = [Completion(c.token_ids, (own[i] + 1.0).tolist(), True) for i, c in enumerate(rows)]
    judged = decode_profile.judge_rows(oracle, prompts, 2, shifted, 4)
    assert judged["gap_mean"] == pytest.approx(1.0, abs=1e-4) and judged["logprob_mean"] == silent["logprob_mean"]

    # the law's stop mass at each generated position: all of it for the whole vocabulary, the sampled token's own
    # probability for a stop set of that token alone, and more for a larger set
    sevens = [Completion([7, 7, 7], [], False) for _ in range(4)]
    assert torch.allclose(stop_mass(oracle, prompts, 2, sevens, range(decode_profile.TINY.vocab_size)), torch.ones(12))
    alone = stop_mass(oracle, prompts, 2, sevens, (7,))
    assert torch.allclose(alone, sampled_logprobs(oracle, prompts, 2, sevens)[0].exp(), atol=1e-6)
    assert (stop_mass(oracle, prompts, 2, sevens, (7, 8)) > alone).all()
    assert "stop_mass_mean" not in silent  # no stop set given: no stop verdict


def _tiny_model(tmp_path):
    from miniverl.models.random_init import build_random_model

    return build_random_model(decode_profile.TINY, torch.float32, "cpu", tmp_path / "m")
