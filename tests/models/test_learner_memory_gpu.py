"""The learner's peak memory at the real vocabulary size (151,936), on a GPU: a tiny decoder with Qwen2.5's
vocabulary, 8 rows x 512 response tokens in one micro-batch, GKD top-64 loss + backward through the fused LM
head, all 4,096 tokens' logits at once against 64-token chunks.
Skipped without CUDA; run by lab/gpu_qlora.sh tests."""

from __future__ import annotations

import pytest
import torch

from miniverl.models.lora import LoraSettings, build_lora_model
from miniverl.models.memory import GIB, learner_logits_bytes
from tests.random_models import save_random_qwen2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
VOCAB, ROWS, PROMPT, TOKENS, CHUNK, K = 151_936, 8, 32, 512, 64, 64
LORA = LoraSettings(8, 16.0, 0.0, ("q_proj", "v_proj"), 0)
# One chunk's vocabulary tensors (0.87 GiB by models/memory.py) plus the model, hidden states and allocator
# slack: the chunked path must stay under this at any response length.
CHUNKED_BOUND_GIB = 2.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide-vocab")
    save_random_qwen2(path, hidden_size=64, intermediate_size=128, vocab_size=VOCAB)
    return path


def peak_gib(model_dir, chunk: int) -> float:
    from miniverl.batches import RolloutBatch, TeacherScores
    from miniverl.models.logprobs import packed_token_loss
    from miniverl.models.packing import pack_rows
    from miniverl.objectives.gkd import GkdObjective

    model = build_lora_model(str(model_dir), LORA, torch.bfloat16, "cuda").train()
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        prompts=torch.randint(0, VOCAB, (ROWS, PROMPT), generator=g),
        prompt_mask=torch.ones(ROWS, PROMPT, dtype=torch.long),
        responses=torch.randint(0, VOCAB, (ROWS, TOKENS), generator=g),
        response_mask=torch.ones(ROWS, TOKENS, dtype=torch.long),
        rollout_log_probs=torch.zeros(ROWS, TOKENS),
        uid=[str(i) for i in range(ROWS)],
        ground_truth=[""] * ROWS,
        policy_version=0,
    )
    top = torch.log_softmax(torch.randn(ROWS, TOKENS, K, generator=g), -1) - 0.1
    scores = TeacherScores(
        teacher_log_probs=torch.zeros(ROWS, TOKENS),
        teacher_topk_logprobs=top.cuda(),
        teacher_topk_ids=torch.randint(0, VOCAB, (ROWS, TOKENS, K), generator=g).cuda(),
        teacher_tail_logprob=torch.full((ROWS, TOKENS), -2.3).cuda(),
    )
    objective = GkdObjective(0.5, 1.0, K)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, _, _ = packed_token_loss(
        model, batch, pack_rows(batch, list(range(ROWS))), scores, objective, None, ROWS * TOKENS, chunk
    )
    loss.backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB


def test_chunked_learner_peak_is_bounded_at_the_real_vocabulary(model_dir):
    chunked = peak_gib(model_dir, CHUNK)
    direct = peak_gib(model_dir, 0)
    print(
        f"learner peak above the model, 8 x 512 tokens at V={VOCAB}: direct {direct:.2f} GiB, chunked ({CHUNK})"
        f" {chunked:.2f} GiB; estimate per chunk {learner_logits_bytes(ROWS, TOKENS, VOCAB, CHUNK) / GIB:.2f} GiB"
    )
    assert chunked <= CHUNKED_BOUND_GIB
    assert direct >= 3 * chunked  # unchunked, all 4,096 tokens' vocabulary buffers exist at once
