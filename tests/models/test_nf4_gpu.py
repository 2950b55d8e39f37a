"""NF4 on a real GPU (skipped without CUDA and bitsandbytes; run by lab/gpu_qlora.sh tests): the 4-bit
base loads double-quantized with the LM head left alone, the chunked learner path matches the direct one
on it, hf_reference serves the learner's own base, and vLLM's bitsandbytes engine is within the gate."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lab.bench.e2e_report import GATE_MAX_GAP_MEAN
from miniverl.models.lora import LoraSettings, build_lora_model
from miniverl.rollout.hf_reference import HFReferenceBackend
from miniverl.rollout.sampling import SamplingParams, row_seeds
from tests.random_models import save_random_qwen2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes"),
]
LORA = LoraSettings(16, 32.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The vLLM GPU tests' tiny random Qwen2 (2048 ids, 2 layers), bf16 on disk."""
    path = tmp_path_factory.mktemp("nf4-model")
    save_random_qwen2(path, hidden_size=256, intermediate_size=512, vocab_size=2048)
    return path


def test_nf4_base_is_double_quantized_and_the_adapter_trains(model_dir):
    import bitsandbytes as bnb

    model = build_lora_model(str(model_dir), LORA, torch.bfloat16, "cuda", "nf4")
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 2 * 7  # every decoder linear layer; the LM head stays bf16
    state = four_bit[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested and four_bit[0].compute_dtype == torch.bfloat16
    assert not isinstance(model.get_base_model().lm_head, bnb.nn.Linear4bit)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


class SumOfLogprobs:
    """A stand-in objective whose loss is minus the sum of the sampled tokens' log-probs."""

    token_terms = None

    def token_loss(self, logprobs, terms, sampler_logprobs, advantages, num_step_tokens):
        return -logprobs


def test_chunked_path_matches_direct_on_nf4(model_dir):
    from miniverl.batches import RolloutBatch
    from miniverl.models.logprobs import packed_token_loss
    from miniverl.models.packing import pack_rows

    model = build_lora_model(str(model_dir), LORA, torch.bfloat16, "cuda", "nf4")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        prompts=torch.randint(300, 2048, (4, 8), generator=g),
        prompt_mask=torch.ones(4, 8, dtype=torch.long),
        responses=torch.randint(300, 2048, (4, 37), generator=g),
        response_mask=torch.ones(4, 37, dtype=torch.long),
        rollout_log_probs=torch.zeros(4, 37),
        uid=["a", "a", "b", "b"],
        ground_truth=["", "", "", ""],
        policy_version=0,
    )
    grads = []
    for chunk in (0, 16):
        model.zero_grad()
        loss, _, _ = packed_token_loss(
            model, batch, pack_rows(batch, [0, 1, 2, 3]), None, SumOfLogprobs(), None, 1, chunk
        )
        loss.backward()
        grads.append([p.grad.float().clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)  # bf16 compute: matmul shapes differ per chunk


def test_hf_reference_and_vllm_serve_the_learners_nf4_base(model_dir):
    from lab.bench.oracle import logprob_gaps
    from tests.rollout.test_vllm_gpu import STOPS, adapter, prompts, settings

    learner_side = HFReferenceBackend(str(model_dir), LORA, torch.bfloat16, "cuda", "nf4")
    weights = adapter(learner_side.adapter_weights(), 1)
    learner_side.load_adapter(weights)
    params = SamplingParams(n=2, max_new_tokens=32, temperature=1.0, stop_token_ids=STOPS)
    ps = prompts(8)
    own = learner_side.generate(ps, params, row_seeds(3, 16))
    assert float(logprob_gaps(learner_side, ps, 2, own).mean()) < 1e-2  # the same 4-bit weights, same code
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM not installed: the hf_reference half ran")
    from miniverl.rollout.vllm import VllmBackend

    engine = VllmBackend(str(model_dir), LORA, torch.bfloat16, "cuda", settings("adapter", quantization="nf4"))
    try:
        engine.load_adapter(weights)
        out = engine.generate(ps, params, row_seeds(3, 16))
        gap = float(logprob_gaps(learner_side, ps, 2, out).mean())
        print(f"vLLM bitsandbytes vs NF4 learner: mean gap {gap:.4f} nats")
        assert gap <= GATE_MAX_GAP_MEAN
    finally:
        engine.close()
