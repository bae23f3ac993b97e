"""A `rollout serve` service outlives its trainers (issue 25, finding 5): trainers attach one
after another -- the next after the last closed cleanly, and after the last was SIGKILLed -- and
each one's weights reach the engine (the ack's checksums are that trainer's, greedy decodes
match the reference at its version). Engines follow each trainer's MACed announcement to its
store instead of keeping the first trainer's rendezvous for life."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from proc_io import read_until, stop_all
from test_multihost_loopback import CMD, PROMPTS, _reference, _trainer, _weights

from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams
from rollout.weights.state import state_dict_checksum

pytestmark = [pytest.mark.timeout(240), pytest.mark.heavy]  # heavy: .ci/run runs it

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
OPTIONS = {"auth_token": "s3", "sync_timeout_s": 20.0}

# A trainer in a process of its own: attach, push `version`, then wait to be killed.
TRAINER = """
import sys
from test_multihost_loopback import _weights
from rollout.rl.manager import RolloutManager
address, version = sys.argv[1], int(sys.argv[2])
manager = RolloutManager(coordinator_address=address, dp=1,
                         cluster_options={"auth_token": "s3", "sync_timeout_s": 20.0})
manager.update_weights(_weights(version), version)
print("pushed", version, flush=True)
sys.stdin.readline()
"""


def _push(address: str, version: int) -> None:
    """Attach a trainer, push `version`, check the engine serves exactly it, close."""
    with RolloutManager(coordinator_address=address, dp=1, cluster_options=OPTIONS) as manager:
        assert [s.completion_tokens for s in manager.generate(PROMPTS, sampling_params=SP)] == (
            _reference(version - 1)
        )  # what the trainer before it left
        manager.update_weights(_weights(version), version)
        acks = manager.engine.last_sync
        assert sorted(acks) == [0] and acks[0]["received"] == manager.engine.cluster.sync.digest
        assert acks[0]["checksum"] == state_dict_checksum(_trainer(version))
        got = manager.generate(PROMPTS, sampling_params=SP)
        assert [s.completion_tokens for s in got] == _reference(version)
        assert all(s.weight_versions == [version] for s in got)


def test_successive_and_restarted_trainers_all_push_weights():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ROLLOUT_AUTH_TOKEN": "s3"}
    serve = subprocess.Popen([*CMD, "serve", "--model", "tiny", "--dp", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    procs = [serve]
    try:
        address = read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        _push(address, 1)
        _push(address, 2)  # after the first closed cleanly
        tests = os.path.dirname(__file__)
        killed = subprocess.Popen([sys.executable, "-c", TRAINER, address, "3"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**env, "PYTHONPATH": os.pathsep.join([os.getcwd(), tests])})  # fmt: skip
        procs.append(killed)
        read_until(killed, r"pushed 3")
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        _push(address, 4)  # after a trainer died without a word
        assert serve.poll() is None
    finally:
        stop_all(procs)
