"""The weight-sync rendezvous: a torch TCPStore that listens on one chosen interface only.

torch's TCPStore server listens on every interface whatever host it is given, and anyone who
reaches its port can read and write every key: it has no authentication. The store here is
therefore bound explicitly, to loopback by default, and engines trust nothing in it that the
trainer did not MAC (rollout.weights.trust): an update's generation, backend and members come in
the MACed announcement, not from the store; aborts and the committed version are MACed; the
broadcast's checksums are MACed in its trailer. What the store still decides alone is liveness:
someone who reaches it can stall or fail a group's forming (a denial of service, never weights
of their own). Binding another interface (engines on other hosts) needs the coordinator's secret
(no MAC without it) and is best kept to a private network: the broadcast's bytes are not
encrypted.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
from collections.abc import Callable

import torch.distributed as dist

from rollout.weights.broadcast import WeightSyncError
from rollout.weights.trust import digest

LOOPBACK = "127.0.0.1"
# Keys the trainer writes and the engines read (weights.trainer_sync, weights.engine_sync)
COMMITTED_KEY = "rollout/weight_sync/committed"  # msgpack [version, MAC]: applied to every member
# The purposes of the trainer's MACs (rollout.weights.trust.sign)
ANNOUNCE, ABORT, COMMITTED = "announce", "abort", "committed"
# What an announcement's MAC covers, besides the version (large payloads by their digest)
ANNOUNCED = ("host", "port", "timeout_s", "store", "generation", "backend", "members")


def announcement_fields(version: int, announcement: dict) -> list:
    """The fields of a SET_WEIGHT_VERSION announcement its MAC covers, in a fixed order."""
    return [version, *(announcement.get(k) for k in ANNOUNCED), digest(announcement.get("ipc"))]


def is_loopback(host: str) -> bool:
    """`host` is an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def open_store(host: str = LOOPBACK, port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """A master TCPStore listening on `host` alone (port 0: a free one, see `store.port`)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(512)
        bound_port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    fd = listener.detach()  # the store owns the listening socket from here on
    try:
        return dist.TCPStore(
            host,
            bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def abort_key(generation: int | str) -> str:
    """Set by the trainer when it gave up on a generation's transfer (a member died in it):
    the engines still blocked in it abandon it (rollout.weights.broadcast.Abort). Its value,
    msgpack [why, MAC], is what they check: a key written by anyone else is ignored."""
    return f"rollout/weight_sync/{generation}/aborted"


def open_group(
    backend: str,
    store: dist.Store,
    generation: int | str,
    rank: int,
    size: int,
    timeout_s: float,
    local_host: str | None = None,
) -> dist.ProcessGroup:
    """One generation's process group, built directly (not torch's default group, nor in its
    registry): the trainer keeps its own default group if it has one, and a group abandoned
    after an abort, whose collectives may stay blocked until their timeout, never stands in
    the way of the next generation's.

    `local_host`: the address gloo binds and tells its peers. Left to itself gloo takes the
    address the hostname resolves to, which is loopback on many machines (Debian's 127.0.1.1),
    so peers on other hosts could never connect. `GLOO_SOCKET_IFNAME`, when set, wins."""
    prefixed = dist.PrefixStore(f"rollout/weight_sync/{generation}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    if local_host is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(prefixed, rank, size, options)


def open_group_unless(
    aborted: Callable[[], bool],
    backend: str,
    store_address: tuple[str, int],
    generation: int | str,
    rank: int,
    size: int,
    timeout_s: float,
    local_host: str | None = None,
    poll_s: float = 0.2,
) -> dist.ProcessGroup:
    """`open_group`, given up as soon as `aborted()` is true. Forming a group waits for every
    member, so one that died would hold the rest until the timeout. The attempt runs in a
    thread of its own, on a store connection of its own (a TCPStore client holds its lock for
    the whole of a wait, which would block the caller's own store calls); an abandoned attempt
    ends there at its timeout, and a group it still forms is dropped."""
    done, abandoned, box = threading.Event(), threading.Event(), {}

    def form() -> None:
        try:
            client = dist.TCPStore(*store_address, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
            box["group"] = open_group(backend, client, generation, rank, size, timeout_s,
                                      local_host)  # fmt: skip
            if abandoned.is_set():
                drop_group(box.pop("group"), timeout_s)
        except BaseException as e:
            box["error"] = e
        done.set()

    threading.Thread(target=form, name="rollout-weight-group", daemon=True).start()
    while not done.wait(poll_s):
        if aborted():
            abandoned.set()
            raise WeightSyncError(f"weight-sync group {generation} abandoned while it formed "
                                  "(a member left)", transport_broken=True)  # fmt: skip
    if "error" in box:
        raise box["error"]
    return box["group"]


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (what a peer there can reach us at): the
    source address the kernel picks for a UDP socket connected to it (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def gloo_host_of_trainer(host: str) -> str | None:
    """The address the trainer's gloo binds: the store's own interface, unless that is a
    wildcard (then gloo's default, or GLOO_SOCKET_IFNAME)."""
    return None if host in ("0.0.0.0", "::", "") else host


def drop_group(group: dist.ProcessGroup | None, linger_s: float) -> None:
    """Let a group go without blocking the caller. NCCL communicators are aborted (that also
    ends a kernel blocked on a dead peer). A gloo group's destructor waits for its collectives,
    and one blocked on a dead peer ends only at its timeout: so a timer thread holds the last
    reference for `linger_s` (the group's timeout) and the wait, if any, happens there."""
    if group is None:
        return
    if group.name() == "nccl":
        with contextlib.suppress(Exception):
            group.abort()
    keeper = threading.Timer(linger_s, list.clear, args=([group],))
    keeper.daemon = True
    keeper.start()
