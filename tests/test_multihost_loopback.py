"""A RolloutManager attached to engines it did not start (`rollout serve` plus a `rollout engine`
that joins it, as on another host), on loopback: every engine serves the trainer's weights at
every version (checksums in the update acks and greedy decodes against the no-cache reference),
an engine that dies leaves the sync group and later updates complete on the rest, and an engine
that comes back takes no work until it has the current weights. This trainer keeps no snapshot
(`weights_snapshot=None`), so the next update brings them; with one (the default) the trainer
catches the engine up at once (tests/test_weight_catch_up.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from proc_io import read_until, stop_all
from reference import greedy

from rollout.models import build_model
from rollout.models.config import ModelConfig
from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams
from rollout.weights.state import state_dict_checksum

pytestmark = pytest.mark.timeout(240)

CMD = [sys.executable, "-m", "rollout.cli"]
PROMPTS = [[256, 10 + i, 20, 30, 40, 50] for i in range(6)]


def _engine(address: str, rank: int, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([*CMD, "engine", "--coordinator", address, "--rank", str(rank),
                             "--model", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)  # fmt: skip
    read_until(proc, rf"engine {rank} pid")
    return proc


def _weights(version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at `version`: the tiny preset's (seed 0, what `--model tiny`
    loads) plus a version-specific perturbation."""
    base = build_model(ModelConfig.preset("tiny", vocab_size=259), seed=0).state_dict()
    g = torch.Generator().manual_seed(version)
    out = {k: v + 0.05 * version * torch.randn(v.shape, generator=g) for k, v in base.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied: one tensor, one value
    return out


def _trainer(version: int) -> torch.nn.Module:
    model = build_model(ModelConfig.preset("tiny", vocab_size=259), seed=0).eval()
    model.load_state_dict(_weights(version))
    return model


def _reference(version: int) -> list[list[int]]:
    return [greedy(_trainer(version), p, 6) for p in PROMPTS]


def _wait(fn, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # polling the coordinator's view of its engines, bounded


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_manager_attached_to_joined_engines(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ROLLOUT_AUTH_TOKEN": "s3"}
    serve = subprocess.Popen([*CMD, "serve", "--model", "tiny", "--dp", "1",
                              "--auth-token-file", str(secret)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    procs = [serve]
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
    try:
        address = read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        procs.append(_engine(address, 1, env))
        manager = RolloutManager(coordinator_address=address, dp=2,
                                 cluster_options={"auth_token": "s3", "sync_timeout_s": 20.0,
                                                  "weights_snapshot": None})  # fmt: skip
        with manager:
            cluster = manager.engine.cluster

            def engines() -> dict:
                return cluster.stats()["engines"]

            assert [s.completion_tokens for s in manager.generate(PROMPTS, sampling_params=sp)] == _reference(0)  # fmt: skip
            for version in (1, 2):
                manager.update_weights(_weights(version), version)
                acks = manager.engine.last_sync
                assert sorted(acks) == [0, 1]
                assert {a["checksum"] for a in acks.values()} == {state_dict_checksum(_trainer(version))}  # fmt: skip
                got = manager.generate(PROMPTS * 2, sampling_params=sp)  # both engines serve
                assert [s.completion_tokens for s in got] == _reference(version) * 2
                assert all(s.weight_versions == [version] for s in got)

            procs[1].send_signal(signal.SIGKILL)  # an engine host dies
            procs[1].wait(30)
            _wait(lambda: sorted(engines()) == [0], 30, "the coordinator dropping the dead engine")
            manager.update_weights(_weights(3), 3)  # the group re-forms without it
            assert sorted(manager.engine.last_sync) == [0]
            got = manager.generate(PROMPTS, sampling_params=sp)
            assert [s.completion_tokens for s in got] == _reference(3)

            procs.append(_engine(address, 1, env))  # the host comes back with its initial weights
            _wait(lambda: 1 in engines(), 60, "the returning engine registering")
            held = engines()[1]  # it serves version 0, the trainer is at 3
            assert held["syncing"] and held["weight_version"] == 0
            got = manager.generate(PROMPTS * 2, sampling_params=sp)
            assert [s.completion_tokens for s in got] == _reference(3) * 2  # none went to it
            assert engines()[1]["assigned"] == 0
            manager.update_weights(_weights(4), 4)  # its first update: it is caught up
            acks = manager.engine.last_sync
            assert sorted(acks) == [0, 1] and acks[1]["weight_version"] == 4
            assert {a["checksum"] for a in acks.values()} == {state_dict_checksum(_trainer(4))}
            assert not engines()[1]["syncing"]
            got = manager.generate(PROMPTS * 3, sampling_params=sp)
            assert [s.completion_tokens for s in got] == _reference(4) * 3
        # closing the attached manager leaves the service running
        assert serve.poll() is None and procs[2].poll() is None
    finally:
        stop_all(procs)


def test_llm_attached_to_a_running_service(tmp_path):
    """`LLM(coordinator_address=...)`: the same attach for plain inference and weight pushes;
    shutting it down leaves the service serving."""
    from rollout.llm import LLM
    from rollout.tokenizers import ByteTokenizer

    secret = tmp_path / "token"
    secret.write_text("s4\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serve = subprocess.Popen([*CMD, "serve", "--model", "tiny", "--dp", "1",
                              "--auth-token-file", str(secret)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
    try:
        address = read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        llm = LLM(None, ByteTokenizer(), coordinator_address=address, auth_token="s4",
                  cluster_options={"sync_timeout_s": 20.0})  # fmt: skip
        try:
            assert [r.generated_tokens for r in llm.generate(PROMPTS, sp)] == _reference(0)
            llm.update_weights(_weights(1), 1)
            got = llm.generate(PROMPTS, sp)
            assert [r.generated_tokens for r in got] == _reference(1)
            assert llm.cluster.attached == address
        finally:
            llm.shutdown()
        assert serve.poll() is None
    finally:
        stop_all([serve])
