"""Stop tokens that give a random-weight model responses of a chosen median length.

A random-init model's next-token law is nearly uniform, so with S stop ids out of V every new token ends the row
with chance S / V: lengths are geometric, with median ln 2 / (S / V). `stop_set` picks S = ln 2 x V / median ids.
Shared by the decode profile and the peers harness; imports nothing heavy (the harness promises no torch at import).
"""

from __future__ import annotations

import math
import random


def stop_set(median: int, vocab: int, seed: int) -> tuple[int, ...]:
    """~ln(2) V / median random token ids: a per-step stop chance of ln 2 / median on a uniform next-token law."""
    if median <= 0:
        return ()
    k = max(1, round(math.log(2) * vocab / median))
    return tuple(sorted(random.Random(seed).sample(range(vocab), k)))
