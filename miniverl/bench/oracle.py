"""Judge a cell's samples by the oracle: teacher-force them through the oracle's model and compare the
log-prob each backend reported for each sampled token with the oracle's.

Teacher forcing, not sequence equality, is the test on a GPU: on random-init weights the logits are
nearly uniform, so bf16 rounding flips sampled tokens and sequences diverge without anything being
wrong (DESIGN.md); the log-prob of the tokens actually sampled still has to agree.
"""

from __future__ import annotations

import torch

from miniverl.batches import PromptBatch
from miniverl.models.logprobs import response_logits, token_logprobs
from miniverl.rollout import Completion
from miniverl.workers.rollout import to_rollout_batch

# Rows scored per forward: 8 rows x ~600 positions of 152k-vocabulary logits stay near a GiB in bf16.
ORACLE_CHUNK_ROWS = 8


def _teacher_forced(oracle, prompts: list[list[int]], n: int, completions: list[Completion]):
    """The rows in chunks of ORACLE_CHUNK_ROWS with the oracle's logits over their responses.

    Yields (part, logits [b, Tr, V], mask [b, Tr] bool) on the oracle's device.
    """
    completions = [
        c if c.logprobs else Completion(c.token_ids, [0.0] * len(c.token_ids), c.finished) for c in completions
    ]
    uids = [str(i) for i in range(len(prompts))]
    batch = to_rollout_batch(PromptBatch(prompts, uids, [""] * len(prompts)), completions, n, version=0)
    device = next(oracle.model.parameters()).device
    for start in range(0, len(batch), ORACLE_CHUNK_ROWS):
        part = batch.rows(start, min(start + ORACLE_CHUNK_ROWS, len(batch)))
        yield part, response_logits(oracle.model, part), part.response_mask.bool().to(device)


@torch.no_grad()
def sampled_logprobs(
    oracle, prompts: list[list[int]], n: int, completions: list[Completion]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's teacher-forced log-prob of every generated token and the one the backend reported (0 where it
    reported none), rows concatenated.

    Shapes: -> ([tokens], [tokens]) float32 on the CPU.
    """
    judged, reported = [], []
    for part, logits, mask in _teacher_forced(oracle, prompts, n, completions):
        judged.append(token_logprobs(logits, part.responses.to(logits.device))[mask].float().cpu())
        reported.append(part.rollout_log_probs[mask.cpu()])
    return torch.cat(judged), torch.cat(reported)


@torch.no_grad()
def stop_mass(oracle, prompts: list[list[int]], n: int, completions: list[Completion], stop_ids) -> torch.Tensor:
    """The probability the oracle's law (temperature 1, untruncated) gives the stop set at every generated
    position: its mean is the stop hazard (stops per generated token) a backend sampling that law must show on
    these rows, whatever their lengths.

    Shapes: -> [tokens] float32 on the CPU.
    """
    masses = []
    for _, logits, mask in _teacher_forced(oracle, prompts, n, completions):
        stops = torch.as_tensor(list(stop_ids), device=logits.device)
        log_mass = torch.logsumexp(logits[..., stops].float(), -1) - torch.logsumexp(logits.float(), -1)
        masses.append(log_mass[mask].exp().cpu())
    return torch.cat(masses)


def logprob_gaps(oracle, prompts: list[list[int]], n: int, completions: list[Completion]) -> torch.Tensor:
    """|reported - oracle| log-prob of every generated token, rows concatenated.

    Shapes: -> [tokens] float32 on the CPU.
    """
    judged, reported = sampled_logprobs(oracle, prompts, n, completions)
    return (reported - judged).abs()


def identical_fraction(a: list[Completion], b: list[Completion]) -> float:
    """Fraction of rows with the same token ids (informational on GPUs; see the module note)."""
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / max(1, len(a))
