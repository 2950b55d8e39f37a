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


@torch.no_grad()
def teacher_forced(
    oracle, prompts: list[list[int]], n: int, completions: list[Completion], stop_ids=()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One teacher-forced pass of the rows through the oracle, in chunks of ORACLE_CHUNK_ROWS: the oracle's log-prob
    of every generated token, the one the backend reported (0 where it reported none), and with `stop_ids` the
    probability the oracle's law (temperature 1, untruncated) gives the stop set at every generated position (its
    mean is the stop hazard, stops per generated token, a backend sampling that law must show on these rows,
    whatever their lengths; None without stop ids). Rows concatenated.

    Shapes: -> ([tokens], [tokens], [tokens] or None) float32 on the CPU.
    """
    completions = [
        c if c.logprobs else Completion(c.token_ids, [0.0] * len(c.token_ids), c.finished) for c in completions
    ]
    uids = [str(i) for i in range(len(prompts))]
    batch = to_rollout_batch(PromptBatch(prompts, uids, [""] * len(prompts)), completions, n, version=0)
    device = next(oracle.model.parameters()).device
    stops = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)
    judged, reported, masses = [], [], []
    for start in range(0, len(batch), ORACLE_CHUNK_ROWS):
        part = batch.rows(start, min(start + ORACLE_CHUNK_ROWS, len(batch)))
        logits = response_logits(oracle.model, part)  # [b, Tr, V]
        mask = part.response_mask.bool()
        judged.append(token_logprobs(logits, part.responses.to(device)).cpu()[mask].float())
        reported.append(part.rollout_log_probs[mask])
        if stops.numel():
            log_mass = torch.logsumexp(logits[..., stops].float(), -1) - torch.logsumexp(logits.float(), -1)
            masses.append(log_mass.cpu()[mask].exp())
    return torch.cat(judged), torch.cat(reported), torch.cat(masses) if masses else None


def sampled_logprobs(
    oracle, prompts: list[list[int]], n: int, completions: list[Completion]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's teacher-forced log-prob of every generated token and the one the backend reported (0 where it
    reported none), rows concatenated.

    Shapes: -> ([tokens], [tokens]) float32 on the CPU.
    """
    judged, reported, _ = teacher_forced(oracle, prompts, n, completions)
    return judged, reported


def stop_mass(oracle, prompts: list[list[int]], n: int, completions: list[Completion], stop_ids) -> torch.Tensor:
    """The law's stop probability at every generated position (teacher_forced's third part).

    Shapes: -> [tokens] float32 on the CPU.
    """
    return teacher_forced(oracle, prompts, n, completions, stop_ids)[2]


def logprob_gaps(oracle, prompts: list[list[int]], n: int, completions: list[Completion]) -> torch.Tensor:
    """|reported - oracle| log-prob of every generated token, rows concatenated.

    Shapes: -> [tokens] float32 on the CPU.
    """
    judged, reported = sampled_logprobs(oracle, prompts, n, completions)
    return (reported - judged).abs()


def identical_fraction(a: list[Completion], b: list[Completion]) -> float:
    """Fraction of rows with the same token ids (informational on GPUs; see the module note)."""
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / max(1, len(a))
