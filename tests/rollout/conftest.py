"""One torch thread for these tests: the models are tiny, and on a shared 2-core box two OpenMP threads
made one small matmul 15 ms instead of 3 us (measured), which is all noise and no parallelism."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
