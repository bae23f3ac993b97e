"""Several machines, simulated with network namespaces: the coordinator (`rollout serve`, with its
own engine) and the trainer on one host, a `rollout engine` on each of two others, every host
with its own address on a private bridge (tests/netns_hosts.py), everything bound to those
addresses, so requests, results and weight broadcasts cross the bridge.

The trainer (tests/netns_trainer.py, a process in its host's namespace) runs a short GRPO loop
and reports what it saw as JSON: at every version each engine acks the trainer's checksum and
greedy decodes equal the no-cache reference of the trainer's weights; every handed-out token's
versions and staleness agree with the versions pushed, and each greedy token is the one its
claimed version's weights choose. One engine host is frozen, given requests and killed
mid-run: its requests are re-dispatched, later updates go to the others, the run completes.

No process is told its interface (no GLOO_SOCKET_IFNAME): the hostname resolves to loopback
here, so this also checks that weight sync binds gloo to the address facing the other hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import netns_hosts
import pytest
from netns_hosts import Host, NetnsUnavailable
from proc_io import read_until

pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-m", "rollout.cli"]
DRIVER = str(Path(__file__).with_name("netns_trainer.py"))
VERSIONS, KILL_AFTER, VICTIM = 4, 2, 2  # rank 2 (host engine2) dies after version 2


@pytest.fixture
def hosts() -> Iterator[dict[str, Host]]:
    stack = contextlib.ExitStack()
    try:
        made = stack.enter_context(netns_hosts.hosts(["trainer", "engine1", "engine2"]))
    except NetnsUnavailable as e:
        pytest.skip(f"cannot create network namespaces: {e}")
    with stack:
        yield made


class Processes:
    """Children started in their own process groups, their output kept for failure reports."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen] = []
        self.output: dict[str, list[str]] = {}

    def start(self, name: str, host: Host, argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(host.command(argv), text=True, env=self.env,
                                start_new_session=True, **kw)  # fmt: skip
        self.procs.append(proc)
        self.output[name] = []
        return proc

    def keep_reading(self, name: str, proc: subprocess.Popen) -> None:
        """Drain the rest of `proc`'s output (a full pipe would stall it)."""

        def drain() -> None:
            for line in proc.stdout:
                self.output[name].append(line)

        threading.Thread(target=drain, daemon=True).start()

    def stop(self) -> None:
        for p in self.procs:
            for sig in (signal.SIGTERM, signal.SIGCONT):  # a frozen host must wake to exit
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    def report(self) -> str:
        return "\n".join(f"--- {n}\n{''.join(lines)[-3000:]}" for n, lines in self.output.items())


def _serve(procs: Processes, host: Host, token: Path) -> str:
    """`rollout serve` (coordinator and engine 0) on `host`, bound to its address."""
    proc = procs.start("serve", host, [*CLI, "serve", "--model", "tiny", "--dp", "1",
                       "--host", host.address, "--auth-token-file", str(token)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    address = read_until(proc, r"coordinator (tcp://\S+) pid")[1]
    procs.keep_reading("serve", proc)
    return address


def _engine(procs: Processes, host: Host, rank: int, address: str, token: Path) -> subprocess.Popen:
    proc = procs.start(f"engine{rank}", host, [*CLI, "engine", "--coordinator", address,
                       "--rank", str(rank), "--model", "tiny", "--auth-token-file", str(token)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    read_until(proc, rf"engine {rank} pid")
    procs.keep_reading(f"engine{rank}", proc)
    return proc


def _trainer(
    procs: Processes, host: Host, address: str, token: Path, tmp: Path
) -> subprocess.Popen:
    with open(tmp / "trainer.log", "w") as log:
        return procs.start("trainer", host, [sys.executable, DRIVER, "--coordinator", address,
                           "--token-file", str(token), "--sync-host", host.address,
                           "--out", str(tmp / "trainer.json"), "--dp", "3",
                           "--victim", str(VICTIM), "--versions", str(VERSIONS),
                           "--kill-after", str(KILL_AFTER)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)  # fmt: skip


def _signal(proc: subprocess.Popen, sig: int, reply: str, trainer: subprocess.Popen) -> None:
    """`sig` to an engine host's processes, then tell the trainer."""
    os.killpg(proc.pid, sig)
    if sig == signal.SIGKILL:
        proc.wait(30)
    trainer.stdin.write(reply + "\n")
    trainer.stdin.flush()


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_grpo_across_namespaces(hosts, tmp_path):
    token = tmp_path / "token"
    token.write_text("netns-secret\n")
    token.chmod(0o600)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    procs = Processes(env)
    rx_before = {n: netns_hosts.rx_bytes(h) for n, h in hosts.items()}
    try:
        address = _serve(procs, hosts["trainer"], token)
        assert address.startswith(f"tcp://{hosts['trainer'].address}:")
        engines = {r: _engine(procs, hosts[f"engine{r}"], r, address, token) for r in (1, 2)}
        trainer = _trainer(procs, hosts["trainer"], address, token, tmp_path)
        read_until(trainer, r"^FREEZE", timeout=120)
        _signal(engines[VICTIM], signal.SIGSTOP, "frozen", trainer)
        read_until(trainer, r"^KILL", timeout=60)
        _signal(engines[VICTIM], signal.SIGKILL, "killed", trainer)
        read_until(trainer, r"^DONE", timeout=120)
        assert trainer.wait(30) == 0
        result = json.loads((tmp_path / "trainer.json").read_text())
        rx = {n: netns_hosts.rx_bytes(h) - rx_before[n] for n, h in hosts.items()}
    except BaseException:
        with contextlib.suppress(OSError):
            procs.output["trainer"] = [(tmp_path / "trainer.log").read_text(errors="replace")]
        print(procs.report())
        raise
    finally:
        procs.stop()
    _check(result, rx)


def _check(result: dict, rx: dict[str, int]) -> None:
    assert "error" not in result, result["error"]
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed, json.dumps(failed, indent=1)[:4000]
    acks = {
        int(v): {int(r): a for r, a in by_rank.items()} for v, by_rank in result["acks"].items()
    }
    assert sorted(acks) == list(range(1, VERSIONS + 1))
    for v, by_rank in acks.items():
        ranks = [0, 1, 2] if v <= KILL_AFTER else [0, 1]
        assert sorted(by_rank) == ranks, (v, by_rank)
        assert {a["checksum"] for a in by_rank.values()} == {result["trainer_checksums"][str(v)]}
        assert all(a["weight_version"] == v and a["transport"] == "broadcast"
                   for a in by_rank.values())  # fmt: skip
        assert result["engine_versions"][str(v)] == {str(r): v for r in ranks}
    assert result["redispatched"] > 0
    stale = [p for b in result["batches"][1:] for s in b["policy_staleness"] for p in s]
    assert max(stale) >= 1  # partial rollouts carried across updates were handed out
    for r in (1, 2):  # the updates an engine host acked crossed its link to the bridge
        assert rx[f"engine{r}"] >= sum(a[r]["bytes"] for a in acks.values() if r in a)
