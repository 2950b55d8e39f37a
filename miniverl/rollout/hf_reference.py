"""The reference sampler: one full forward pass over every unfinished sequence per new token.

No KV cache, no compilation, nothing shared between rows: slow, and obviously correct. It is the
oracle that faster backends are checked against (same weights + same seeds -> same tokens).
"""

from __future__ import annotations

import torch

from miniverl.models.logprobs import sequence_logprobs
from miniverl.models.lora import LoraSettings, adapter_state, build_lora_model, live_adapter, load_adapter_state
from miniverl.policy import weights_digest
from miniverl.rollout import Completion
from miniverl.rollout.sampling import SamplingParams, sample_next
from miniverl.served_policy import probe_tolerance


def left_pad(seqs: list[list[int]], pad_id: int = 0, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes: -> ids [B, T] long, mask [B, T] long (left-padded to T: the longest sequence, or `width` if wider)."""
    t = max(max(map(len, seqs)), width)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, t - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, t - len(s) :] = 1
    return ids, mask


class HFReferenceBackend:
    def __init__(
        self, model_path: str, lora: LoraSettings, dtype: torch.dtype, device: str, quantization: str = "none"
    ) -> None:
        """`quantization` nf4 serves the 4-bit base exactly as the learner loads it (models/loading.py)."""
        self.device = device
        self.model = build_lora_model(model_path, lora, dtype, device, quantization).eval()
        self.probe_tolerance = probe_tolerance(dtype)

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        load_adapter_state(self.model, weights)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.model)

    def served_digest(self) -> str:
        """The peft model's own adapter tensors, which its forward reads (the oracle: found anew each time)."""
        return weights_digest(live_adapter(self.model))

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Through the model it samples with: the peft model, adapter applied on the fly."""
        return sequence_logprobs(self.model, sequences)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        rows = [list(p) for p in prompts for _ in range(params.n)]
        if len(seeds) != len(rows):
            raise ValueError(f"need one seed per completion ({len(rows)}), got {len(seeds)}")
        seed_of_row = torch.tensor(seeds, dtype=torch.long, device=self.device)
        done = [Completion([], [], False) for _ in rows]
        stop = set(params.stop_token_ids)
        active = list(range(len(rows)))
        for step in range(params.max_new_tokens):
            ids, mask = left_pad([rows[i] + done[i].token_ids for i in active])
            logits = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=(mask.cumsum(1) - 1).clamp(min=0).to(self.device),
                use_cache=False,
                logits_to_keep=1,  # only the next-token logits: [b, T, V] would not fit at real vocab sizes
            ).logits[:, -1]  # [b, V]
            index = torch.tensor(active, device=self.device)
            tokens, logprobs = sample_next(logits, params, seed_of_row[index], step)
            for i, tok, lp in zip(active, tokens.tolist(), logprobs.tolist()):
                done[i].token_ids.append(tok)
                done[i].logprobs.append(lp)
                done[i].finished = tok in stop
            active = [i for i in active if not done[i].finished]
            if not active:
                break
        return done
