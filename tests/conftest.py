"""Shared test setup: offline W&B, deterministic torch, few threads (2-core CI machine)."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield
