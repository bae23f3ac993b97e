"""Bytes changed in the middle of an authenticated broadcast are refused even when they keep
the transport checksum (`sum`) intact.

Someone in the middle of the gloo broadcast relays the trainer's MACed trailer and changes
chunk bytes. Two words of one 4 KiB row, one +1 and one -1, leave `sum` exactly as it was (the
row sums do not change), so before chunk digests were keyed every engine applied those bytes.
Two processes, no coordinator: the test is the trainer, a spawned process the engine; the
sender's `on_bucket` hook (which runs after chunk i is digested, before it goes out) plays the
man in the middle.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rollout.weights.broadcast import WeightReceiver, WeightSender, WeightSyncError
from rollout.weights.chunk_digest import resolve_algo
from rollout.weights.layout import bucket_checksum
from rollout.weights.rendezvous import open_group, open_store
from rollout.weights.trust import weight_key

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 30.0
KEY = weight_key("the coordinator's secret")
NUMEL = 64 << 10  # 256 KiB of float32: four 64 KiB chunks


def _sum_preserving(chunk: torch.Tensor) -> None:
    """Word 0 of the first row +1, word 1 -1: the same row sum, so the same `sum`."""
    words = chunk[:16].clone().view(torch.int64)
    words[0] += 1
    words[1] -= 1
    chunk[:16].copy_(words.view(torch.uint8))


CASES = [("g1", "auto", True), ("g2", "auto", False), ("g3", "sum", True)]


def _engine(port: int, out) -> None:
    """The receiving rank (a spawned process): one update per case, each on its own group."""
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False)
    for generation, _, _ in CASES:
        target = {"w": torch.zeros(NUMEL)}
        group = open_group("gloo", store, generation, 1, 2, TIMEOUT_S)
        try:
            WeightReceiver(target, group, key=KEY, context=generation).receive()
            refused = None
        except WeightSyncError as e:
            refused = str(e)
        out.put((refused, bool(target["w"].any()), bool((target["w"] == 1).all())))


@pytest.fixture(scope="module")
def outcomes() -> dict[str, tuple]:
    """Each case's (receiver's error or None, target changed, target is the trainer's) and
    (sender's error or None, whether the tampering kept `sum`)."""
    store = open_store(timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_engine, args=(store.port, out), daemon=True)
    child.start()
    results = {}
    try:
        for generation, checksum, tamper in CASES:
            kept: list[bool] = []

            def man_in_the_middle(i: int, chunk: torch.Tensor, tamper=tamper, kept=kept) -> None:
                if tamper and i == 1:
                    before = bucket_checksum(chunk, "sum")
                    _sum_preserving(chunk)
                    kept.append(before == bucket_checksum(chunk, "sum"))

            group = open_group("gloo", store, generation, 0, 2, TIMEOUT_S)
            sender = WeightSender(group, bucket_bytes=64 << 10, checksum=checksum, key=KEY,
                                  context=generation)  # fmt: skip
            try:
                sender.send({"w": torch.ones(NUMEL)}, 1, man_in_the_middle)
                sent = None
            except WeightSyncError as e:
                sent = str(e)
            results[generation] = (out.get(timeout=TIMEOUT_S), (sent, kept))
    finally:
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
    return results


def test_sum_preserving_bytes_are_refused_when_authenticated(outcomes):
    (refused, changed, _), (sent, kept) = outcomes["g1"]
    assert kept == [True]  # the change really kept `sum` as it was
    assert refused is not None and "checksum mismatch" in refused, refused
    assert sent is not None and "not applied anywhere" in sent
    assert not changed  # nothing applied


def test_keyed_digests_apply_an_untouched_update(outcomes):
    (refused, _, trainers), (sent, _) = outcomes["g2"]
    assert refused is None and sent is None and trainers


def test_explicit_sum_is_honoured_and_cannot_see_the_change(outcomes):
    """The documented residual of `sum` (what CUDA keeps by default): the change goes through."""
    (refused, changed, trainers), (sent, kept) = outcomes["g3"]
    assert kept == [True]
    assert refused is None and sent is None and changed and not trainers


def test_the_algorithm_is_chosen_by_name():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_algo("auto", KEY, cpu) == "keyed"
    assert resolve_algo("auto", KEY, cuda) == "sum"
    assert resolve_algo("auto", None, cpu) == "sum"
    assert resolve_algo("crc32", KEY, cpu) == "crc32"
    with pytest.raises(ValueError, match="md5"):
        resolve_algo("md5", KEY, cpu)
    with pytest.raises(ValueError, match="keyed"):
        resolve_algo("keyed", None, cpu)


def test_the_config_option_reaches_the_sender_and_bad_names_are_refused():
    """`coordinator.weight_sync_checksum` is the user's handle on this trade-off: validated by
    name at config time and by the cluster, and handed to the trainer's sender."""
    from rollout.config import ConfigError, load_config
    from rollout.config.builders import cluster_options
    from rollout.serving.cluster import EngineCluster
    from rollout.weights.trainer_sync import TrainerWeightSync

    run = load_config(["rollout.dp=2", "coordinator.weight_sync_checksum=sum"])
    assert cluster_options(run)["weight_sync_checksum"] == "sum"
    with pytest.raises(ConfigError, match=r"coordinator\.weight_sync_checksum"):
        load_config(["rollout.dp=2", "coordinator.weight_sync_checksum=md5"])
    with pytest.raises(ValueError, match="weight_sync_checksum"):
        EngineCluster(2, None, weight_sync_checksum="md5")
    sync = TrainerWeightSync(1 << 20, 5.0, "broadcast", key=KEY, checksum="sum")
    try:
        assert sync.checksum == "sum"
    finally:
        sync.close()
