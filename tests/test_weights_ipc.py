"""Colocated weight sync (rollout.weights.ipc): engines map the trainer's packed buckets. The CPU
twin (sealed memfds) runs with real engine processes behind a RolloutManager at dp=2; the
CUDA test (`-m cuda`) does the same through CUDA IPC handles on one GPU."""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import torch
from fake_engine import wait_for
from near_tie import assert_greedy_agrees

from rollout.config import ConfigError, load_config, validate
from rollout.config.builders import build_manager, build_model_and_tokenizer, inference_config
from rollout.config.schema import RoutingPolicy, RunConfig, WeightSyncTransport
from rollout.engine.engine import DynamicInferenceEngine
from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams
from rollout.weights import trainer_sync
from rollout.weights.broadcast import WeightSyncError
from rollout.weights.ipc import (
    SHM_PREFIX,
    IpcReceiver,
    IpcSender,
    _open,
    benchmark_ipc_sync,
    plan_buckets,
)
from rollout.weights.layout import plan_layout
from rollout.weights.state import state_dict_checksum
from rollout.weights.trainer_sync import TrainerWeightSync

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=6)
PROMPTS = [[256, *b"hello world!"], [256, *b"reverse me"]]


def _run(transport: str = "ipc", device: str = "cpu") -> RunConfig:
    run = RunConfig()
    run.rollout.dp = 2
    run.model.device = device
    run.engine.num_blocks = 64
    run.engine.block_size = 4
    run.engine.max_sequence_length = 128
    run.coordinator.weight_sync_transport = WeightSyncTransport[transport]
    run.coordinator.heartbeat_s = 0.2
    run.coordinator.engine_timeout_s = 1.0  # a killed engine is noticed within a second
    run.coordinator.policy = RoutingPolicy["round_robin"]  # both engines serve
    return run


def _manager(run: RunConfig) -> tuple[RolloutManager, torch.nn.Module, object]:
    trainer, tok, _ = build_model_and_tokenizer(validate(run))
    manager = build_manager(validate(run), model=trainer, tokenizer=tok)
    manager.engine.cluster.sync.bucket_bytes = 32 << 10  # a dozen buckets for the tiny model
    return manager, trainer, tok


@pytest.fixture(scope="module")
def ctx():
    run = _run()
    manager, trainer, tok = _manager(run)
    yield {"run": validate(run), "manager": manager, "trainer": trainer, "tok": tok}
    manager.close()


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.device))


def _direct(ctx, model) -> list:
    """Greedy records of a fresh in-process engine holding `model`'s weights, with top-2
    log-probs: the cluster batches otherwise, so its greedy tokens agree up to the first near
    tie (tests/near_tie.py)."""
    engine = DynamicInferenceEngine(
        copy.deepcopy(model).eval(), ctx["tok"], inference_config(ctx["run"])
    )
    return engine.generate(PROMPTS, GREEDY.replace(top_n_logprobs=2))


def _versions(m: RolloutManager) -> set[int]:
    return {e["weight_version"] for e in m.engine.cluster.stats()["engines"].values()}


def _segments(pid: int) -> list[str]:
    """The weight-sync memfds `pid` holds open (its staged or kept buckets)."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{SHM_PREFIX}"):
                    out.append(fd)
    return out


def _shm_files(pid: int) -> list[str]:
    """Files in /dev/shm named for `pid`'s weights (what the memfds replaced)."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"{SHM_PREFIX}{pid}-")]


def _mapped_segments(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if SHM_PREFIX in line]


# ---- in-process pieces ----------------------------------------------------------------------


def test_buckets_cut_between_tensors_and_tile_the_stream():
    sd = {"a": torch.zeros(10), "b": torch.zeros(3000), "c": torch.zeros(5), "d": torch.zeros(7)}
    slots, total = plan_layout(sd)
    buckets = plan_buckets(slots, total, 256)
    assert buckets[0][0] == 0 and buckets[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(buckets))
    starts = {s.offset for s in slots}
    assert all(start in starts for start, _ in buckets)  # every cut is a tensor boundary
    assert (slots[1].offset, slots[2].offset) in buckets  # "b" (12 KB) is a bucket of its own


def test_receiver_refuses_bad_payloads_and_keeps_its_weights():
    src = {"w": torch.randn(64, 8), "b": torch.randn(8)}
    dst = {"w": torch.zeros(64, 8), "b": torch.zeros(8)}
    receiver = IpcReceiver(dst, version=3)
    sender = IpcSender(bucket_bytes=1024)
    with sender.stage(src, 3) as staged, pytest.raises(WeightSyncError, match="not increase"):
        receiver.receive(staged.payload)
    with sender.stage(src, 4) as staged, pytest.raises(WeightSyncError, match="announced 5"):
        receiver.receive(staged.payload, expected_version=5)
    wrong = {"w": torch.randn(64, 9)}
    with sender.stage(wrong, 4) as staged, pytest.raises(WeightSyncError, match=r"\(64, 9\)"):
        receiver.receive(staged.payload)
    with pytest.raises(WeightSyncError, match="unreadable"):
        receiver.receive(b"\x93garbage")
    evil = msgpack.unpackb(sender.stage(src, 4).payload)
    with open("/etc/passwd") as other:
        evil["buckets"][0][3] = ["memfd", os.getpid(), other.fileno()]
        with pytest.raises(WeightSyncError, match="not a weight-sync memfd"):
            receiver.receive(msgpack.packb(evil))
    unsealed = os.memfd_create(f"{SHM_PREFIX}{os.getpid()}")  # named like ours, writable
    try:
        os.ftruncate(unsealed, 1 << 16)
        evil["buckets"][0][3] = ["memfd", os.getpid(), unsealed]
        with pytest.raises(WeightSyncError, match="not sealed against writes"):
            receiver.receive(msgpack.packb(evil))
    finally:
        os.close(unsealed)
    assert not dst["w"].any() and receiver.version == 3
    with sender.stage(src, 4) as staged:
        assert receiver.receive(staged.payload, expected_version=4).num_tensors == 2
    assert torch.equal(dst["w"], src["w"]) and receiver.version == 4
    sender.close()
    assert _segments(os.getpid()) == []


def test_auto_transport_is_ipc_only_on_the_engines_device(monkeypatch):
    sync = TrainerWeightSync(1 << 20, 5.0, "auto", torch.device("cpu"))
    try:
        cpu, meta = {"w": torch.zeros(2)}, {"w": torch.zeros(2, device="meta")}
        assert sync.transport_for(meta) == "broadcast"  # not where the engines are
        assert sync.transport_for(cpu) == ("ipc" if "cpu" in trainer_sync.AUTO_IPC_DEVICES
                                           else "broadcast")  # fmt: skip
        monkeypatch.setattr(trainer_sync, "AUTO_IPC_DEVICES", ("cuda",))
        assert sync.transport_for(cpu) == "broadcast"
        sync.transport = "ipc"
        assert sync.transport_for(meta) == "ipc"  # explicit: whatever the device
        gpu = TrainerWeightSync(1 << 20, 5.0, "auto", torch.device("cuda"))
        assert gpu.engine_device == torch.device("cuda", 0)
        gpu.close()
    finally:
        sync.close()


def test_config_validates_the_transport():
    with pytest.raises(ConfigError, match="weight_sync_transport"):
        load_config(["coordinator.weight_sync_transport=nccl"])
    run = load_config(["coordinator.weight_sync_transport=ipc"])
    assert run.coordinator.weight_sync_transport == "ipc"


# ---- real engine processes (CPU twin) -------------------------------------------------------


def test_update_is_bit_identical_versioned_and_serves_like_a_fresh_engine(ctx):
    m, trainer = ctx["manager"], ctx["trainer"]
    for step in range(2):
        _perturb(trainer, step)
        version = m.update_weights(trainer)
        acks = m.engine.last_sync
        assert sorted(acks) == [0, 1]
        assert {a["transport"] for a in acks.values()} == {"ipc"}
        assert {a["checksum"] for a in acks.values()} == {state_dict_checksum(trainer)}
        assert _versions(m) == {version}
        samples = m.generate(PROMPTS, n=2, sampling_params=GREEDY)
        assert all(s.token_versions == [version] * 6 for s in samples)
        assert all(s.policy_staleness == [0] * 6 for s in samples)
        assert_greedy_agrees([s.completion_tokens for s in samples[::2]], _direct(ctx, trainer))
        assert_greedy_agrees([s.completion_tokens for s in samples[1::2]], _direct(ctx, trainer))


def test_corrupted_bucket_is_refused_and_the_old_weights_keep_serving(ctx):
    m, trainer = ctx["manager"], ctx["trainer"]
    old, good = m.version, _direct(ctx, trainer)
    nxt = copy.deepcopy(trainer)
    _perturb(nxt, 50)

    def flip(i: int, bucket: torch.Tensor) -> None:
        if i == 3:  # after its checksum was taken
            bucket[17] ^= 0x40

    with pytest.raises(WeightSyncError, match="did not apply") as info:
        m.engine.cluster.update_weights(nxt, old + 1, on_bucket=flip)
    assert "checksum mismatch in bucket(s) [3]" in str(info.value)
    assert _versions(m) == {old}
    samples = m.generate(PROMPTS, n=2, sampling_params=GREEDY)
    assert all(s.token_versions == [old] * 6 for s in samples)
    assert_greedy_agrees([s.completion_tokens for s in samples[::2]], good)

    def fail(i: int, bucket: torch.Tensor) -> None:
        raise RuntimeError("trainer died while packing")

    with pytest.raises(WeightSyncError, match="before any engine saw it"):
        m.engine.cluster.update_weights(nxt, old + 1, on_bucket=fail)
    assert _versions(m) == {old}
    assert m.update_weights(nxt) == old + 1  # the next update goes through
    assert {a["checksum"] for a in m.engine.last_sync.values()} == {state_dict_checksum(nxt)}
    trainer.load_state_dict(nxt.state_dict())


def test_twenty_updates_leave_no_segment_or_mapping_behind(ctx):
    m, trainer = ctx["manager"], ctx["trainer"]
    cluster = m.engine.cluster
    m.update_weights(trainer)
    kept = _segments(os.getpid())
    assert kept  # the buckets of one version, kept for the next
    for _ in range(20):
        m.update_weights(trainer)
    assert sorted(_segments(os.getpid())) == sorted(kept)  # reused, not one set per update
    for p in cluster.engine_processes:
        assert _mapped_segments(p.pid) == []  # engines unmapped every bucket
    cluster.sync.ipc.close()
    assert _segments(os.getpid()) == []
    version = m.update_weights(trainer)
    assert _versions(m) == {version}


KILLED_TRAINER = """
import os, signal, sys, torch
from rollout.weights.ipc import IpcSender
sender = IpcSender()
staged = sender.stage({"w": torch.ones(1 << 20)}, version=1)  # held: SIGKILL before release
print(os.getpid(), staged.payload.hex(), flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_trainer_leaves_no_weights_in_shared_memory():
    """A SIGKILLed trainer runs no cleanup: its buckets are memfds, gone with the process (no
    file in /dev/shm at any time), and their handles no longer open."""
    child = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    pid, payload = child.stdout.readline().split()
    buckets = msgpack.unpackb(bytes.fromhex(payload))["buckets"]
    assert _segments(int(pid)) and _shm_files(int(pid)) == []  # held by the trainer only
    assert _open(buckets[0][3], 16).numel() == 16  # readable while it lives
    child.communicate("\n", timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert _shm_files(int(pid)) == []
    with pytest.raises(FileNotFoundError):
        _open(buckets[0][3], 16)


def test_engine_killed_mid_sync_does_not_block_and_restarts_on_the_new_weights(ctx, monkeypatch):
    m, trainer = ctx["manager"], ctx["trainer"]
    cluster = m.engine.cluster
    m.update_weights(trainer)
    victim = cluster.engine_processes[1]
    restarts = cluster.supervision_stats()["restarts"]
    stage = cluster.sync.ipc.stage

    def kill(i: int, bucket: torch.Tensor) -> None:
        if i == 2:
            os.kill(victim.pid, signal.SIGKILL)

    monkeypatch.setattr(cluster.sync.ipc, "stage", lambda sd, v, on_bucket=None: stage(sd, v, kill))
    _perturb(trainer, 77)
    t0 = time.monotonic()
    version = m.update_weights(trainer)
    assert time.monotonic() - t0 < cluster.sync_timeout_s / 2
    monkeypatch.undo()
    acks = m.engine.last_sync
    assert list(acks) == [0] and acks[0]["weight_version"] == version
    wait_for(lambda: cluster.supervision_stats()["restarts"] == restarts + 1, 60, "restart")
    wait_for(lambda: sorted(cluster.stats()["engines"]) == [0, 1], 60, "2 engines")
    assert _versions(m) == {version}
    samples = m.generate(PROMPTS, n=2, sampling_params=GREEDY)  # round robin: both serve
    assert all(s.token_versions == [version] * 6 for s in samples)
    assert_greedy_agrees([s.completion_tokens for s in samples[::2]], _direct(ctx, trainer))
    assert_greedy_agrees([s.completion_tokens for s in samples[1::2]], _direct(ctx, trainer))
    m.update_weights(trainer)  # the restarted engine takes updates again
    assert sorted(m.engine.last_sync) == [0, 1]


def test_broadcast_and_ipc_alternate_on_one_cluster(ctx, monkeypatch):
    """The process-group broadcast stays a working transport (auto picks it for trainer tensors
    elsewhere): an aborted transfer keeps the old version, the next one builds a fresh group, and
    switching back to ipc leaves the group behind."""
    m, trainer = ctx["manager"], ctx["trainer"]
    cluster = m.engine.cluster
    wait_for(lambda: sorted(cluster.stats()["engines"]) == [0, 1], 60, "2 engines")
    monkeypatch.setattr(cluster.sync, "transport", "broadcast")
    _perturb(trainer, 5)
    version = m.update_weights(trainer)
    assert {a["transport"] for a in m.engine.last_sync.values()} == {"broadcast"}
    assert {a["checksum"] for a in m.engine.last_sync.values()} == {state_dict_checksum(trainer)}

    def die(i: int, buf: torch.Tensor) -> None:
        if i == 3:
            raise RuntimeError("trainer killed mid-transfer")

    with pytest.raises(WeightSyncError, match="failed"):
        cluster.update_weights(trainer, version + 1, on_bucket=die)
    assert _versions(m) == {version}
    _perturb(trainer, 6)
    version = m.update_weights(trainer)  # a fresh group after the aborted transfer
    assert {a["checksum"] for a in m.engine.last_sync.values()} == {state_dict_checksum(trainer)}
    monkeypatch.undo()
    version = m.update_weights(trainer)
    assert {a["transport"] for a in m.engine.last_sync.values()} == {"ipc"}
    assert sorted(m.engine.last_sync) == [0, 1] and _versions(m) == {version}


def test_benchmark_reports_seconds_per_gb_and_identical_weights():
    before = _segments(os.getpid())
    out = benchmark_ipc_sync(4 << 20, "cpu", bucket_bytes=1 << 20, repeats=1)
    assert out["identical"] and out["ipc_s_per_gb"] > 0 and out["copy_s_per_gb"] > 0
    assert _segments(os.getpid()) == before


# ---- CUDA: the same through CUDA IPC handles on one GPU -------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_colocated_update_through_ipc_handles():
    run = _run(transport="auto", device="cuda")
    manager, trainer, tok = _manager(run)
    ctx = {"run": validate(run), "manager": manager, "trainer": trainer, "tok": tok}
    try:
        assert next(trainer.parameters()).is_cuda
        _perturb(trainer, 1)
        version = manager.update_weights(trainer)
        acks = manager.engine.last_sync
        assert {a["transport"] for a in acks.values()} == {"ipc"}  # auto: same device
        assert {a["checksum"] for a in acks.values()} == {state_dict_checksum(trainer)}
        samples = manager.generate(PROMPTS, n=2, sampling_params=GREEDY)
        assert all(s.token_versions == [version] * 6 for s in samples)
        assert_greedy_agrees([s.completion_tokens for s in samples[::2]], _direct(ctx, trainer))
        nxt = copy.deepcopy(trainer)
        _perturb(nxt, 2)

        def flip(i: int, bucket: torch.Tensor) -> None:
            if i == 1:
                bucket[5] ^= 0x01

        with pytest.raises(WeightSyncError, match="checksum mismatch"):
            manager.engine.cluster.update_weights(nxt, version + 1, on_bucket=flip)
        assert _versions(manager) == {version}
        assert manager.update_weights(nxt) == version + 1
        assert {a["checksum"] for a in manager.engine.last_sync.values()} == {
            state_dict_checksum(nxt)
        }
        out = benchmark_ipc_sync(256 << 20, "cuda")
        assert out["identical"] and out["ipc_s_per_gb"] > 0
    finally:
        manager.close()
