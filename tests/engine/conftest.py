"""Run these tests single-threaded: tiny models gain nothing from threads, and on a busy 2-core
machine OpenMP's spin-waiting makes a 2-thread forward of a tiny model up to 100x slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
