"""Two GKD steps of the real SmolLM2-135M-Instruct on the CPU (in-process, no Ray): the addition_chat task behind its
chat template, a teacher shown solved demonstrations, the numeric reward, stopping on <|im_end|>. The run that the
recipe +experiment=smollm2_addition makes, at a size the suite can afford."""

from __future__ import annotations

import torch

from miniverl.models.lora import LoraSettings
from miniverl.objectives.gkd import GkdObjective
from miniverl.process import ProcessSettings
from miniverl.rollout.sampling import SamplingParams
from miniverl.setup.prepare import prepare
from miniverl.step.controller import StrictSyncController
from miniverl.step.evaluation import evaluate
from miniverl.workers.learner import LearnerWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.scorer import ScorerWorker
from tests.test_config import load

CPU = ProcessSettings("cpu")
LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_seed=0)


def test_two_steps_of_the_real_model_with_a_context_teacher(real_model_dir):
    model = str(real_model_dir)
    cfg = load(
        "+experiment=smollm2_addition",
        f"model.student.path={model}",
        f"model.teacher.path={model}",
        "data.teacher_demonstrations=2",
        "data.prompts_per_step=2",
        "data.eval_prompts=4",
        "trainer.total_steps=2",
    )
    setup = prepare(cfg, log=lambda *_: None)
    tok = setup.tokenizer
    assert setup.stop_token_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")
    prompts = setup.prompts.batch(0, 2)
    assert tok.decode(prompts.prompt_ids[0]).endswith("<|im_start|>assistant\n")
    assert len(prompts.teacher_prompt_ids[0]) > len(prompts.prompt_ids[0]) + 20  # two solved turns before the question
    objective = GkdObjective(beta=0.5, loss_temperature=1.0, teacher_topk=8)
    rollout = RolloutWorker("hf_cached", model, LORA, "float32", CPU)
    scorer = ScorerWorker(model, "float32", 4, CPU)
    learner = LearnerWorker(model, LORA, "float32", objective, 3e-4, 0.0, 1.0, 4, CPU)
    ctl = StrictSyncController(rollout, scorer, learner, setup.reward_fn, 8, 1.0)
    params = SamplingParams(2, 8, 1.0, stop_token_ids=setup.stop_token_ids, seed=0)
    for step in range(2):
        metrics = ctl.step(setup.prompts.batch(step, 2), params)
        assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["loss"] > 1e-4  # the context is a signal
    assert learner.version == 2
    result = evaluate(ctl, setup.eval_batch, 12, setup.stop_token_ids, 0, setup.reward_fn, tok, 2)
    assert 0.0 <= result.metrics["eval/accuracy"] <= 1.0 and result.metrics["eval/reverse_kl"] > 0
    assert result.samples[0]["ground_truth"].isdigit()
