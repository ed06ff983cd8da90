"""pytest fixtures; the shared helper functions and override lists are in helpers.py."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config


@pytest.fixture
def one_thread():
    """One torch thread during the test (as hardware.threads=1 sets it), the previous count afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def compose_cfg():
    return compose_config
