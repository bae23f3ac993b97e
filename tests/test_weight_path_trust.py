"""Only the trainer's weights reach the engines (issue 25, findings 1, 2 and 13).

A local attacker process that can reach the weight-sync store and shared memory, but does not
hold the coordinator's secret, tries three things against a RolloutManager at dp=2 (real engine
processes): (a) between the trainer's publishing of an ipc update and the engines' reading it,
it replaces the staged payload with buckets of its own (its own checksums) and writes into the
trainer's buckets; (b) before any update it pre-writes the abort key of the next few thousand
generations; (c) between two broadcast updates it points the engines at a process group of its
own (rewrites the generation key) and sends its weights as the next version. In every case the
update is applied with the trainer's own checksum (acked by every engine) or refused with a
clear error, and the engines serve the previous version until then.

In-process: an engine refuses an announcement whose MAC does not verify (a forged payload or
generation, none, another key) and ignores forged aborts and committed versions; the trainer
refuses an ack whose received checksum is not its own, naming the engine; without a secret the
weight store cannot leave loopback.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import msgpack
import pytest
import torch
from near_tie import assert_greedy_agrees
from safetensors.torch import save_file
from test_weights_ipc import GREEDY, PROMPTS, _direct, _manager, _perturb, _run, _versions

from rollout.config import validate
from rollout.serving.weight_updates import check_agreement
from rollout.weights.broadcast import WeightSyncError
from rollout.weights.engine_sync import EngineWeightSync
from rollout.weights.ipc import IpcSender
from rollout.weights.rendezvous import COMMITTED_KEY, abort_key
from rollout.weights.state import copy_weights_, state_dict_checksum
from rollout.weights.trainer_sync import TrainerWeightSync
from rollout.weights.trust import weight_key

pytestmark = pytest.mark.timeout(240)

ATTACK_TIMEOUT_S = 60.0

# The attacker: everything a local process without the secret can do to the weight path.
ATTACKER = r"""
import datetime, json, mmap, os, sys
import msgpack, torch, torch.distributed as dist
from safetensors.torch import load_file
from rollout.weights.layout import bucket_checksum

attack, port, trainer, version, weights = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
report = {"payload_replaced": False, "bytes_written": 0, "denied": 0}

def own_segment(nbytes, i):
    path = f"/dev/shm/rollout-weights-{os.getpid()}-{i}"
    with open(path, "wb") as f:
        f.write(bytes(nbytes))  # all-zero weights
    return path

if attack == "ipc":
    key = "rollout/weight_sync/ipc"  # where a staged payload was once published
    if store.check([key]):
        staged = msgpack.unpackb(store.get(key))
        algo = msgpack.unpackb(staged["manifest"])["checksum"]
        for i, row in enumerate(staged["buckets"]):
            n = row[1] - row[0]
            row[2] = bucket_checksum(torch.zeros(n, dtype=torch.uint8), algo)
            row[3] = ["shm", own_segment(n, i)]
        store.set(key, msgpack.packb(staged))
        report["payload_replaced"] = True
    targets = [f"/dev/shm/{f}" for f in os.listdir("/dev/shm") if f.startswith(f"rollout-weights-{trainer}-")]
    for fd in os.listdir(f"/proc/{trainer}/fd"):
        link = os.readlink(f"/proc/{trainer}/fd/{fd}") if os.path.exists(f"/proc/{trainer}/fd/{fd}") else ""
        if link.startswith("/memfd:rollout-weights-"):
            targets.append(f"/proc/{trainer}/fd/{fd}")
    for path in targets:  # the trainer's own buckets, in place
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            report["denied"] += 1
            continue
        try:
            report["bytes_written"] += os.pwrite(fd, b"\xff" * 64, 0)
        except OSError:
            report["denied"] += 1
        try:
            mm = mmap.mmap(fd, 64)
            mm[:64] = b"\xff" * 64
            report["bytes_written"] += 64
        except OSError:
            report["denied"] += 1
        os.close(fd)

if attack == "aborts":  # every generation the trainer could use next, aborted in advance
    keys = [f"rollout/weight_sync/{n}/aborted" for n in range(1, 3001)]
    store.multi_set(keys, ["pre-written"] * len(keys))
    report["bytes_written"] = len(keys)

if attack == "group":  # the engines' next update: our group, our weights
    from rollout.weights.broadcast import WeightSender
    from rollout.weights.rendezvous import open_group
    store.set("rollout/weight_sync/generation", "999:gloo:0,1")
    print(json.dumps(report), flush=True)  # the keys are in place; now wait for the engines
    group = open_group("gloo", store, 999, 0, 3, 30.0)
    WeightSender(group, bucket_bytes=1 << 20).send(load_file(weights), version)
    report["payload_replaced"] = True
print(json.dumps(report), flush=True)
"""


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    run = _run()
    manager, trainer, tok = _manager(run)
    manager.engine.cluster.sync.timeout_s = 20.0  # an update the attacker stalls fails in 20 s
    evil = tmp_path_factory.mktemp("attacker") / "zeros.safetensors"
    save_file({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in trainer.state_dict().items()},
              str(evil))  # fmt: skip
    yield {"run": validate(run), "manager": manager, "trainer": trainer, "tok": tok, "evil": evil}
    manager.close()


def _attacker(ctx, attack: str, version: int) -> subprocess.Popen:
    port = ctx["manager"].engine.cluster.sync.store.port
    args = [attack, str(port), str(os.getpid()), str(version), str(ctx["evil"])]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, "-c", ATTACKER, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def _report(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=ATTACK_TIMEOUT_S)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def _serves(ctx, version: int, model: torch.nn.Module) -> None:
    """Both engines hold `version` and answer like a fresh engine holding `model` (greedy tokens
    up to the first near tie: the cluster batches otherwise; tests/near_tie.py)."""
    m = ctx["manager"]
    assert _versions(m) == {version}
    samples = m.generate(PROMPTS, n=2, sampling_params=GREEDY)  # round robin: both engines
    assert all(s.token_versions == [version] * 6 for s in samples)
    want = _direct(ctx, model)
    assert_greedy_agrees([s.completion_tokens for s in samples[::2]], want)
    assert_greedy_agrees([s.completion_tokens for s in samples[1::2]], want)


def _applied_or_refused(ctx, nxt: torch.nn.Module, old: int, old_model: torch.nn.Module) -> bool:
    """Push `nxt`: True when every engine acked the trainer's own checksum, False when it was
    refused with the engines still on `old`. Anything else fails the test."""
    m = ctx["manager"]
    try:
        version = m.update_weights(nxt)
    except WeightSyncError as e:
        assert str(e)
        _serves(ctx, old, old_model)
        return False
    acks = m.engine.last_sync
    assert sorted(acks) == [0, 1]
    own = state_dict_checksum(nxt)
    assert {a["checksum"] for a in acks.values()} == {own}
    assert {a["received"] for a in acks.values()} == {m.engine.cluster.sync.digest}
    _serves(ctx, version, nxt)
    return True


def test_a_payload_rewritten_between_publish_and_apply_never_reaches_an_engine(ctx, monkeypatch):
    m, trainer = ctx["manager"], ctx["trainer"]
    cluster = m.engine.cluster
    m.update_weights(trainer)
    old, old_model = m.version, _copy(trainer)
    nxt = _copy(trainer)
    _perturb(nxt, 11)
    transfer, report = cluster.sync.transfer, {}

    def attacked(sd, version, members, on_bucket, announce):
        def attack_then_announce():  # published (staged, and wherever it is handed over)
            report.update(_report(_attacker(ctx, "ipc", version)))
            return announce()

        return transfer(sd, version, members, on_bucket, attack_then_announce)

    monkeypatch.setattr(cluster.sync, "transfer", attacked)
    assert _applied_or_refused(ctx, nxt, old, old_model)
    assert report == {"payload_replaced": False, "bytes_written": 0, "denied": report["denied"]}
    assert report["denied"] >= 2  # it found the trainer's buckets and could not write them
    trainer.load_state_dict(nxt.state_dict())


def test_pre_written_abort_keys_cannot_stop_any_update(ctx, monkeypatch):
    m, trainer = ctx["manager"], ctx["trainer"]
    cluster = m.engine.cluster
    old, old_model = m.version, _copy(trainer)
    assert _report(_attacker(ctx, "aborts", 0))["bytes_written"] == 3000
    monkeypatch.setattr(cluster.sync, "transport", "broadcast")
    cluster.sync.broken()  # the next update forms a new generation: the next number
    for seed in (21, 22):
        nxt = _copy(trainer)
        _perturb(nxt, seed)
        assert _applied_or_refused(ctx, nxt, old, old_model)
        old, old_model = m.version, nxt
    monkeypatch.undo()
    nxt = _copy(trainer)
    _perturb(nxt, 23)
    assert _applied_or_refused(ctx, nxt, old, old_model)  # ipc, too
    trainer.load_state_dict(nxt.state_dict())


def test_an_intruder_group_between_updates_is_never_joined(ctx, monkeypatch):
    m, trainer = ctx["manager"], ctx["trainer"]
    cluster = m.engine.cluster
    monkeypatch.setattr(cluster.sync, "transport", "broadcast")
    m.update_weights(trainer)  # the group the next update would reuse
    old, old_model = m.version, _copy(trainer)
    intruder = _attacker(ctx, "group", old + 1)
    try:
        assert intruder.stdout.readline()  # its keys are in the store before the update
        nxt = _copy(trainer)
        _perturb(nxt, 31)
        assert _applied_or_refused(ctx, nxt, old, old_model)
        assert intruder.poll() is None  # still waiting for engines that never came
    finally:
        intruder.kill()
        intruder.wait(30)
    trainer.load_state_dict(nxt.state_dict())


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


# ---- in-process: what an engine accepts ------------------------------------------------------


class _Engine:
    """The part of an engine weight sync uses."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(4, 2)
        self.weight_version = 0

    def update_weights(self, views: dict, version: int) -> None:
        copy_weights_(self.model, views)
        self.weight_version = version


def test_engines_act_only_on_what_the_trainer_macs():
    key = weight_key("s3")
    trainer = TrainerWeightSync(1 << 20, 10.0, "ipc", key=key)
    engine = _Engine()
    sync = EngineWeightSync(engine, trainer.worker_info(0), key)
    sender = IpcSender()
    try:
        trainer.store.set(COMMITTED_KEY, msgpack.packb([7, b"x" * 32]))  # forged: ignored
        assert sync.committed_version() is None
        trainer.commit(3)
        assert sync.committed_version() == 3
        trainer.prepare([(0, os.getpid())], "gloo")
        gen = trainer.generation
        trainer.store.set(abort_key(gen), msgpack.packb(["forged", b"y" * 32]))
        assert not sync._aborted(gen)
        trainer._mark_aborted("a member died")
        assert sync._aborted(gen)

        sd = {"weight": torch.randn(2, 4), "bias": torch.randn(2)}
        evil = {k: torch.zeros_like(v) for k, v in sd.items()}
        with sender.stage(sd, 1) as staged, sender.stage(evil, 1) as forged:
            trainer.prepare([(0, os.getpid())], "ipc")
            trainer.ipc_payload = staged.payload
            a = trainer.announcement(1)
            for bad, why in (({**a, "ipc": forged.payload}, "not MACed"),
                             ({**a, "generation": "1-0000"}, "not MACed"),
                             ({**a, "mac": None}, "not MACed"),
                             (None, "no weight-sync announcement")):  # fmt: skip
                ack = sync.receive(1, bad)
                assert why in ack["error"] and ack["weight_version"] == 0
            assert not engine.model.weight.eq(sd["weight"]).all()
            other = EngineWeightSync(_Engine(), trainer.worker_info(0), weight_key("other"))
            assert "not MACed" in other.receive(1, a)["error"]
            ack = sync.receive(1, a)
        assert staged.digest is not None
        assert ack["weight_version"] == 1 and ack["received"] == staged.digest
        assert torch.equal(engine.model.weight.detach(), sd["weight"])
    finally:
        sync.close()
        sender.close()
        trainer.close()


def test_a_replayed_committed_version_is_a_rollback_and_refused():
    """The MAC proves origin, not freshness: an older MACed committed version written back is
    refused, for an engine that saw the newer one and for one spawned after it (its floor comes
    from the trainer through its start arguments, not from the store)."""
    key = weight_key("s3")
    trainer = TrainerWeightSync(1 << 20, 10.0, "ipc", key=key)
    seen = EngineWeightSync(_Engine(), trainer.worker_info(0), key)
    try:
        trainer.commit(1)
        old = trainer.store.get(COMMITTED_KEY)
        trainer.commit(2)
        assert seen.committed_version() == 2
        spawned = EngineWeightSync(_Engine(), trainer.worker_info(1), key)
        trainer.store.set(COMMITTED_KEY, old)
        assert seen.committed_version() == 2 and spawned.committed_version() == 2
        trainer.commit(3)
        assert seen.committed_version() == 3
    finally:
        seen.close()
        trainer.close()


def test_without_a_secret_the_weight_store_stays_on_loopback():
    with pytest.raises(ValueError, match=r"beyond loopback.*auth token"):
        TrainerWeightSync(1 << 20, 10.0, host="0.0.0.0", key=None)


def test_an_engine_acking_other_weights_fails_the_update_and_is_named():
    acks = {0: {"weight_version": 2, "checksum": 5, "received": 9},
            1: {"weight_version": 2, "checksum": 5, "received": 7}}  # fmt: skip
    with pytest.raises(WeightSyncError, match=r"engine ranks \[1\] .* not the trainer's"):
        check_agreement(acks, 2, own=9)
    check_agreement({0: acks[0]}, 2, own=9)
