"""The weight-sync rendezvous listens on loopback unless told otherwise (the store has no auth)."""

from __future__ import annotations

import datetime

import psutil
import torch.distributed as dist

from rollout.weights.rendezvous import open_store
from rollout.weights.trainer_sync import TrainerWeightSync


def _listening(port: int) -> list[str]:
    conns = psutil.Process().net_connections(kind="tcp")
    return sorted(c.laddr.ip for c in conns if c.status == "LISTEN" and c.laddr.port == port)


def test_store_listens_on_loopback_only_and_serves_a_client():
    store = open_store(timeout_s=10)
    assert _listening(store.port) == ["127.0.0.1"]  # torch's own store: "::" (every interface)
    client = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    client.set("rollout/k", "v")
    assert store.get("rollout/k") == b"v"


def test_store_binds_the_host_it_is_given():
    store = open_store("::1", timeout_s=10)
    assert _listening(store.port) == ["::1"]


def test_the_trainer_side_of_weight_sync_binds_loopback():
    sync = TrainerWeightSync(bucket_bytes=1 << 20, timeout_s=10)
    try:
        assert _listening(sync.store.port) == ["127.0.0.1"]
        assert sync.worker_info(0)["host"] == "127.0.0.1"
    finally:
        sync.close()
