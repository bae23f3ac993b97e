"""Hosts simulated with Linux network namespaces: one namespace per host, each with its own
address on a private bridge, so traffic between them crosses a real (virtual) link.

The bridge lives in a namespace of its own, joined to each host by a veth pair: nothing is
added to the caller's namespace, and deleting the namespaces deletes every link. Names carry
the creating process's pid; namespaces left by a process that no longer exists (a run killed
before its cleanup) are removed on the next setup. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "rollout-netns-"
IFNAME = "rnet0"  # each host's interface on the bridge (names are per namespace)


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, EPERM)."""


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    address: str  # its address on the bridge

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in `ns`: a namespace outlives its name while any
    process is inside."""
    with contextlib.suppress(RuntimeError):
        for pid in _ip("netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def delete(ns: str) -> None:
    _kill_inside(ns)
    with contextlib.suppress(RuntimeError):
        _ip("netns", "del", ns)


def _remove_orphans() -> None:
    """Namespaces of earlier runs whose process is gone."""
    for ns in namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", ns)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            delete(ns)


def _check_available() -> None:
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"creating network namespaces needs root (euid {os.geteuid()})")


@contextlib.contextmanager
def hosts(names: list[str]) -> Iterator[dict[str, Host]]:
    """One namespace per name, each at 10.X.Y.(2+i)/24 on a bridge of their own; all deleted
    on exit, with any process still inside. NetnsUnavailable when the first namespace cannot
    be created."""
    _check_available()
    _remove_orphans()
    pid = os.getpid()
    subnet = f"10.{200 + pid % 50}.{pid // 50 % 250}"
    switch = f"{PREFIX}{pid}-switch"
    created: list[str] = []
    try:
        try:
            _ip("netns", "add", switch)
        except RuntimeError as e:
            raise NetnsUnavailable(str(e)) from None
        created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        out = {}
        for i, name in enumerate(names):
            host = Host(f"{PREFIX}{pid}-{name}", f"{subnet}.{2 + i}")
            _ip("netns", "add", host.name)
            created.append(host.name)
            _join(switch, host, f"port{i}")
            out[name] = host
        yield out
    finally:
        for ns in reversed(created):
            delete(ns)


def _join(switch: str, host: Host, port: str) -> None:
    """`host`'s namespace on the bridge: lo up, a veth pair (`port` on the bridge, IFNAME in
    the host) and the host's address."""
    _ip("-n", host.name, "link", "set", "lo", "up")
    _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME,
        "netns", host.name)  # fmt: skip
    _ip("-n", switch, "link", "set", port, "master", "br0")
    _ip("-n", switch, "link", "set", port, "up")
    _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", IFNAME)
    _ip("-n", host.name, "link", "set", IFNAME, "up")


def rx_bytes(host: Host) -> int:
    """Bytes `host` has received over the bridge."""
    link = json.loads(_ip("-n", host.name, "-s", "-j", "link", "show", IFNAME))[0]
    return int(link["stats64"]["rx"]["bytes"])
