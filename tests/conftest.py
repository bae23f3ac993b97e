"""Shared test setup: offline W&B, deterministic torch, few threads (2-core CI machine), and
the tiny model most engine tests run (tests/reference.py builds it)."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch
from reference import tiny_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The tiny byte-vocabulary model with seed-0 weights, built once per test module. Tests
    must not change its weights (update_weights on a private `tiny_model()` instead); a module
    that needs other weights defines its own `model`."""
    return tiny_model(seed=0)


@pytest.fixture
def client(served):
    """An httpx client on the module's `served` server (tests/http_serve.py served_fixture),
    with its bearer token; modules with a `client` fixture of their own override this one."""
    import httpx

    with httpx.Client(base_url=served.url, headers=served.auth, timeout=120) as c:
        yield c
