"""The weight-sync rendezvous listens on loopback unless told otherwise (the store has no auth)."""

from __future__ import annotations

import datetime

import psutil
import torch
import torch.distributed as dist

from rollout.weights import rendezvous
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


def test_gloo_binds_the_address_facing_the_peers():
    """Gloo's default is the hostname's address (loopback on many hosts, useless to a peer on
    another host): each side names its own address instead, unless the interface is a wildcard."""
    assert rendezvous.local_address_towards("127.0.0.1", 29500) == "127.0.0.1"
    assert rendezvous.gloo_host_of_trainer("10.1.2.3") == "10.1.2.3"
    assert rendezvous.gloo_host_of_trainer("0.0.0.0") is None
    store = rendezvous.open_store()
    group = rendezvous.open_group("gloo", store, "bind-test", 0, 1, 10.0, local_host="127.0.0.1")
    t = torch.ones(3)
    group.broadcast([t]).wait()
    assert t.tolist() == [1.0, 1.0, 1.0]
