"""lab/real_model/sft.py, the SFT-on-teacher-samples baseline: its refusals (before any model is loaded) and its
loss. The run itself needs the real model (13 minutes on 2 busy cores for 2 steps): its smoke is in the results
README, not here."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "real_model"


@pytest.fixture
def sft(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("sft")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--seed", "0", "--steps", "0"], "--steps 0: need at least 1 step"),
        (["--seed", "-1"], "--seed -1: use a seed >= 0"),
        (["--seed", "0", "--eval-prompts", "0"], "--eval-prompts 0: need >= 1"),
        (["--seed", "0", "--eval-every", "-2"], "--eval-every -2"),
        (["--seed", "0", "trainer.lr"], "write each as key=value"),
        (["--steps", "3"], "--seed"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(sft, tmp_path, capsys, argv, said):
    with pytest.raises(SystemExit) as stop:
        sft.main([*argv, "--out", str(tmp_path / "run")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert said in err[-1] and err[-1].startswith("sft.py: error:")


def test_a_directory_holding_a_run_is_refused(sft, tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit):
        sft.main(["--seed", "0", "--out", str(tmp_path)])
    assert "already holds a run" in capsys.readouterr().err


def test_a_bad_override_is_refused_before_any_model(sft, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        sft.main(["--seed", "0", "--out", str(tmp_path / "run"), "trainer.no_such_key=1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_key" in err[0]
    assert not (tmp_path / "run").exists()  # refused before the run directory, the models and the prompts


def test_loss_is_the_token_mean_cross_entropy_of_the_responses(sft, random_model_dir):
    """Rows of other prompt and response lengths, left- and right-padded: the loss is the mean over every real
    response token (the stop token included) of -log p, each row scored alone without padding."""
    from transformers import AutoModelForCausalLM

    from miniverl.batches import PromptBatch
    from miniverl.rollout import Completion
    from miniverl.workers.rollout import to_rollout_batch

    model = AutoModelForCausalLM.from_pretrained(random_model_dir).eval()
    prompts = PromptBatch([[5, 6, 7, 8], [9, 10]], ["a", "b"], ["x", "y"])
    responses = [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20]]  # n = 2 per prompt
    batch = to_rollout_batch(prompts, [Completion(r, [0.0] * len(r), True) for r in responses], 2, 0)
    with torch.no_grad():
        loss = sft.sft_loss(model, batch)
        terms = []
        for row, response in enumerate(responses):
            ids = torch.tensor([prompts.prompt_ids[row // 2] + response])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # [T, V]
            start = ids.shape[1] - len(response)
            terms += [-logp[start - 1 + t, tok] for t, tok in enumerate(response)]
    assert loss.item() == pytest.approx(torch.stack(terms).mean().item(), abs=1e-5)
