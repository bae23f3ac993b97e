"""SkyRL 0.4's `delta` weight sync (no NCCL, no CUDA) against a real `rollout serve`: its own
`DeltaCheckpointPublisher` writes zstd XOR deltas and its own `SkyrlWeightSyncClient` drives
init -> fetch -> pause(keep) -> reset cache -> start -> update -> finish -> resume, twice (the
second step changes one tensor: a one-record delta on top of the first). After each step the
tokens and log-probs are the new weights' own (<= 1e-5 against a plain forward) and the version
moved by one. skyrl 0.4 needs Python >= 3.12 to install, so scripts/test_frameworks.sh unpacks
its wheel and names the folder in SKYRL04_WHEEL_DIR; tests/clients/skyrl04_trainer.py loads the
modules this needs from it, in a process of its own (skyrl 0.3 is the installed one here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from http_serve import serve_http
from reference import tiny_model

from rollout.models.loader import save_pretrained

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

WHEEL = os.environ.get("SKYRL04_WHEEL_DIR", "")
TRAINER = Path(__file__).with_name("skyrl04_trainer.py")
if not (Path(WHEEL) / "skyrl" / "backends").is_dir():
    pytest.skip("SKYRL04_WHEEL_DIR (skyrl 0.4.0's unpacked wheel, scripts/test_frameworks.sh) "
                "is not set", allow_module_level=True)  # fmt: skip
pytest.importorskip("zstandard")


@torch.no_grad()
def _check(url: str, model: torch.nn.Module, version: int) -> None:
    prompt = [9, 8, 7]
    out = httpx.post(f"{url}/inference/v1/generate", timeout=120, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": 6, "temperature": 0,
                                                 "logprobs": 0}}).json()  # fmt: skip
    choice = out["choices"][0]
    assert choice["weight_versions"] == [version] * 6
    tokens = choice["token_ids"]
    lps = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    ref = torch.log_softmax(model(torch.tensor([prompt + tokens])).float()[0, 2:-1], -1)
    assert tokens == ref.argmax(-1).tolist()
    assert torch.allclose(lps, ref[torch.arange(6), torch.tensor(tokens)], atol=1e-5)


def test_skyrl_delta_sync_drives_rollout_serve(tmp_path):
    base, step1, step2 = tiny_model(seed=0), tiny_model(seed=41), tiny_model(seed=41)
    with torch.no_grad():
        step2.model.norm.weight.mul_(1.5)
    for name, model in (("base", base), ("step1", step1), ("step2", step2)):
        save_pretrained(model, model.config, tmp_path / name)
    served = serve_http(tmp_path, "--block-size", "4", bearer=False)  # SkyRL sends no token
    try:
        url = served.url
        _check(url, base, 0)
        run = subprocess.run(
            [sys.executable, str(TRAINER), WHEEL, url, str(tmp_path / "base"),
             str(tmp_path / "sync"), str(tmp_path / "step1"), str(tmp_path / "step2")],
            capture_output=True, text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        steps = [json.loads(line) for line in run.stdout.splitlines()]
        assert [s["target_version"] for s in steps] == [1, 2]
        assert steps[1]["records"] == 1  # only model.norm.weight changed
        assert (tmp_path / "sync" / "delta-00000002" / "manifest.json").is_file()
        assert int(httpx.get(f"{url}/get_weight_version").json()["weight_version"]) == 2
        _check(url, step2, 2)
    finally:
        served.stop()
