"""Which engines the coordinator lets serve: only the service's model, and only the trainer's
current weights. Real processes on loopback: `rollout serve`, `rollout engine`, a RolloutManager
attached to them.

- An engine started with another model (the right token, other shapes) is refused at
  registration with a message naming what differs; it exits, and the others' updates succeed.
- A `rollout serve` engine SIGKILLed after the trainer pushed version k comes back from its
  checkpoint: it is held out of routing until the trainer's catch-up sent it version k, so every
  greedy answer is version k's and no base-model token is stamped with version k.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from proc_io import read_until, stop_all
from test_multihost_loopback import CMD, PROMPTS, _reference, _weights

from rollout.models import build_model
from rollout.models.config import ModelConfig
from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams
from rollout.serving.model_identity import mismatch, model_identity, refusal

pytestmark = pytest.mark.timeout(180)

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "ROLLOUT_AUTH_TOKEN": "s3"}


class _Engine:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


def _identity(seed: int = 0, **overrides) -> dict:
    config = ModelConfig.preset("tiny", vocab_size=259, **overrides)
    return model_identity(_Engine(build_model(config, seed=seed)))


def test_identity_names_what_differs():
    tiny = _identity()
    assert mismatch(_identity(), tiny) is None
    wider = refusal(_identity(intermediate_size=256), tiny)
    assert "intermediate_size 256 here, 128 in the service" in wider
    assert "model mismatch" in wider and "fingerprint" not in wider  # the telling part only
    renamed = {**tiny, "fingerprint": "0" * 16}  # same numbers, other parameter names
    assert "parameter names or shapes: fingerprint" in mismatch(renamed, tiny)
    half = model_identity(_Engine(build_model(ModelConfig.preset("tiny", vocab_size=259)).half()))
    assert mismatch(half, tiny) == "dtypes 'float16' here, 'float32' in the service"
    assert refusal({"architecture": ["x"]}, tiny).startswith("invalid registration")
    assert refusal(tiny, None) is None  # the first engine sets the service's model


def test_identity_tells_other_weights_of_the_same_model_apart():
    """Another checkpoint of the same architecture: every shape matches, the weights digest
    does not; refused while no trainer pushes weights, admitted (to be held) once one does."""
    tiny, other = _identity(), _identity(seed=1)
    assert mismatch(other, tiny) is None and other["weights"] != tiny["weights"]
    assert _identity()["weights"] == tiny["weights"]  # deterministic: same checkpoint, same digest
    why = refusal(other, tiny)
    assert "model mismatch" in why and f"weights digest {other['weights']!r} here" in why
    assert refusal(other, tiny, weights_managed=True) is None


def _serve(dp: int) -> subprocess.Popen:
    return subprocess.Popen([*CMD, "serve", "--model", "tiny", "--dp", str(dp), "--policy",
                             "round_robin", "--restart-backoff", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV)  # fmt: skip


def _manager(address: str, dp: int, **options) -> RolloutManager:
    opts = {"auth_token": "s3", "sync_timeout_s": 20.0, "bucket_bytes": 64 << 10, **options}
    return RolloutManager(coordinator_address=address, dp=dp, cluster_options=opts)


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_engine_with_another_model_is_refused_and_updates_go_on():
    serve = _serve(1)
    procs = [serve]
    try:
        address = read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        with _manager(address, 1) as manager:
            wrong = subprocess.Popen([*CMD, "engine", "--coordinator", address, "--rank", "1",
                                      "--model", "small"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=ENV)  # fmt: skip
            procs.append(wrong)
            out, _ = wrong.communicate(timeout=90)  # it exits on the refusal
            assert wrong.returncode != 0, out
            assert "model mismatch" in out and "hidden_size 384 here, 64 in the service" in out
            stats = manager.engine.cluster.stats()
            assert sorted(stats["engines"]) == [0]
            assert stats["counters"]["engines_refused_model"] == 1
            assert stats["model"]["hidden_size"] == 64
            assert manager.update_weights(_weights(1), 1) == 1
            assert sorted(manager.engine.last_sync) == [0]
            got = manager.generate(PROMPTS, sampling_params=SP)
            assert [s.completion_tokens for s in got] == _reference(1)
    finally:
        stop_all(procs)


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_restarted_serve_engine_serves_the_trainers_weights_never_the_checkpoints():
    serve = _serve(2)
    try:
        address = read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        pid = int(read_until(serve, r"engine 1 pid (\d+)")[1])
        read_until(serve, r"ready: 2 engine")
        with _manager(address, 2) as manager:
            cluster = manager.engine.cluster
            manager.update_weights(_weights(1), 1)
            os.kill(pid, signal.SIGKILL)
            read_until(serve, r"engine 1 restarted pid")

            def admitted() -> bool:  # the new process registered and takes work
                s = cluster.stats()
                return s["counters"]["engines_registered"] >= 3 and not s["engines"][1]["syncing"]

            deadline = time.monotonic() + 90
            while not admitted():
                assert time.monotonic() < deadline, cluster.stats()
                time.sleep(0.1)  # polling the coordinator's view of its engines, bounded
            got = manager.generate(PROMPTS * 4, sampling_params=SP)  # round robin: both serve
            assert [s.completion_tokens for s in got] == _reference(1) * 4
            assert all(s.weight_versions == [1] for s in got)
            stats = cluster.stats()
            assert stats["engines"][1]["dispatched"] >= len(PROMPTS)  # the restarted one served
            assert stats["engines"][1]["weight_version"] == 1
            assert stats["counters"]["engines_held_for_weights"] == 1
            assert stats["counters"]["engines_admitted_after_sync"] == 1
    finally:
        stop_all([serve])
