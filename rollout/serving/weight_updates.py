"""`WeightUpdates`: the trainer's weights to a cluster's engines, wherever they run.

One update goes to every serving engine through `rollout.weights.trainer_sync` (a SET_WEIGHT_VERSION
control tells each worker to receive it now), all-or-nothing per engine. Every engine's ack
carries the digest of what it received (manifest and chunk checksums); an update counts as
applied only where that equals the trainer's own digest of what it sent (a mismatch is a
WeightSyncError naming the engine). Around that transfer:

- engines that die during it: the cluster watches the coordinator's membership heartbeats, a
  member that leaves aborts the transfer at once (survivors are not left blocked on a dead peer
  until their timeout) and the update is retried on the rest, up to MAX_SYNC_ATTEMPTS tries;
- engines that join (attached) or come back after it: the coordinator holds them out of routing
  (`syncing`) and a background thread here sends them the snapshot of the last pushed version
  at once (never the trainer's module: it may be a step further);
- engines that registered with another version while it ran are retired (spawned clusters).

Updates, catch-ups and engine restarts are serialised by one lock, so a restarted engine starts
from the result of the update in flight.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rollout.weights.broadcast import WeightSyncError

if TYPE_CHECKING:
    from rollout.serving.cluster import EngineCluster

log = logging.getLogger(__name__)

MAX_SYNC_ATTEMPTS = 3  # tries of one update: each retry leaves out the engines that died
CATCH_UP_BACKOFF_S = (1.0, 30.0)  # a failed catch-up is tried again after 1, 2, 4... <= 30 s
Member = tuple[int, int]  # (rank, pid) of a spawned engine; (rank, engine id) when attached


class WeightUpdates:
    """The weight-pushing side of an `EngineCluster` (its `sync` and `snapshot`)."""

    def __init__(self, cluster: EngineCluster) -> None:
        self.cluster = cluster
        self.lock = threading.Lock()  # one update or catch-up at a time; restarts wait for it
        self.counters = dict.fromkeys(
            ("engines_caught_up", "update_retries", "engines_lost_in_update"), 0
        )
        self.last_catch_up: dict[int, dict] = {}  # the acks of the last catch-up
        self._wanted = threading.Event()
        self._closing = threading.Event()  # ends the catch-up thread, and wakes its backoff
        self._thread: threading.Thread | None = None

    def update(
        self, sd: dict[str, torch.Tensor], version: int, on_bucket: Callable | None
    ) -> dict[int, dict]:
        """See `EngineCluster.update_weights`."""
        c = self.cluster
        with self.lock:
            infos = self.push_to_survivors(sd, version, self.serving_engines(), on_bucket)
            if c.snapshot is not None:
                c.snapshot.save(sd, version)
            c.sync.commit(version)
            self._retire_stale(version)
        return infos

    def push_to_survivors(
        self, sd: dict[str, torch.Tensor], version: int, members: list[Member], on_bucket: Any
    ) -> dict[int, dict]:
        """`_push` to `members`; when engines die during a transfer (the group broke and they
        left the coordinator or their process is gone), again to the rest, up to
        MAX_SYNC_ATTEMPTS tries. All-or-nothing per engine: a survivor that applied the version
        before the group broke (its ack says so) is done, the others still serve the previous
        one and take the retry. Every ack must report the trainer's own digest of the transfer
        (the same for every try of one update). Raises WeightSyncError when no engine is left
        or tries run out."""
        done: dict[int, dict] = {}
        own: int | None = None
        lost: list[int] = []
        for attempt in range(1, MAX_SYNC_ATTEMPTS + 1):
            if attempt > 1:
                self.counters["update_retries"] += 1
            try:
                infos = self._push(sd, version, members, on_bucket)
                own = self.cluster.sync.digest
                infos = {**done, **infos}
                check_agreement(infos, version, own)
                return infos
            except WeightSyncError as e:
                own = own if own is not None else self.cluster.sync.digest
                alive = set(self.serving_engines())
                dead = [m for m in members if m not in alive]
                if not e.transport_broken or not dead:
                    raise
                self._lost_in_update(dead, version, attempt)
                lost += [r for r, _ in dead]
                ranks = {r for r, _ in members}
                done.update({int(r): i for r, i in e.acks.items() if int(r) in ranks
                             and i.get("weight_version") == version and "lost" not in i})  # fmt: skip
                members = [m for m in members if m in alive and m[0] not in done]
                last = e
            if not members:
                break
        if done and not members:
            check_agreement(done, version, own)
            return done
        why = ("every engine it was sent to died during the transfer" if not members else
               f"gave up after {MAX_SYNC_ATTEMPTS} attempts, engines died in each")  # fmt: skip
        raise WeightSyncError(f"weight update to version {version}: {why} (ranks {sorted(lost)}); "
                              f"last failure: {last}", transport_broken=True) from last  # fmt: skip

    def serving_engines(self) -> list[Member]:
        """(rank, pid) of each engine whose process is alive and registered with the
        coordinator: a restarted engine is a new member even under its old rank. Attached or
        launched elsewhere (Ray): (rank, the coordinator's engine id) of each registered one."""
        c = self.cluster
        engines = c.stats()["engines"]
        if c.attached is not None or c.remote:  # processes elsewhere: the coordinator's ids
            return sorted((int(r), int(e["engine_id"])) for r, e in engines.items()
                          if not e["stopped"])  # fmt: skip
        procs = [(int(r), c.engine_processes[int(r)]) for r, e in engines.items()
                 if not e["stopped"]]  # fmt: skip
        return sorted((r, p.pid) for r, p in procs if p.is_alive())

    def _push(
        self, sd: dict[str, torch.Tensor], version: int, members: list[Member], on_bucket: Any
    ) -> dict[int, dict]:
        c = self.cluster

        def announce() -> concurrent.futures.Future:
            announcement = c.sync.announcement(version)
            return c.loop.submit(_awaited(lambda: c.client.set_weight_version(version,
                                                                              announcement)))  # fmt: skip

        with self._abort_on_loss(members):
            infos, transport, seconds = c.sync.transfer(sd, version, members, on_bucket, announce)
        ranks = {r for r, _ in members}
        applied = {r: i for r, i in infos.items() if int(r) in ranks and "lost" not in i}
        check_agreement(applied, version, c.sync.digest)
        for i in applied.values():
            i["sender_seconds"], i["transport"] = seconds, transport
        return applied

    @contextlib.contextmanager
    def _abort_on_loss(self, members: list[Member]) -> Any:
        """While a transfer runs, a member that leaves the coordinator (its heartbeat names the
        live engines, and is sent at once when one is removed) aborts it: the survivors are not
        left blocked in collectives with a dead peer until their timeout."""
        c = self.cluster
        client = c.client
        by_id = c.attached is not None or c.remote

        def heard(membership: dict) -> None:
            live = {
                (e[0], e[1]) for e in membership["engines"] if isinstance(e, list) and len(e) >= 2
            }
            ranks = {r for r, _ in live}
            gone = [r for r, i in members
                    if ((r, i) not in live if by_id else r not in ranks)]  # fmt: skip
            if gone:
                c.sync.abort_transfer(f"engine ranks {gone} left during the transfer")

        if client is None or not members:
            yield
            return
        client.membership_callbacks.append(heard)
        try:
            yield
        finally:
            client.membership_callbacks.remove(heard)

    def _lost_in_update(self, dead: list[Member], version: int, attempt: int) -> None:
        self.counters["engines_lost_in_update"] += len(dead)
        for rank, _ in dead:
            self.cluster.event("left_update", rank, {"version": version, "attempt": attempt})

    def _retire_stale(self, version: int) -> None:
        """Engines serving another version (registered while this update ran) restart."""
        c = self.cluster
        if c.supervisor is None:
            return
        for rank, e in c.stats()["engines"].items():
            if c.remote and e["syncing"]:  # held: the catch-up brings it the current weights
                continue
            if not e["stopped"] and e["weight_version"] != version:
                c.supervisor.retire(int(rank))

    # ---- catching up engines that joined after the last update (attached) -----------------

    def start_catch_up(self) -> None:
        """Attached with a snapshot: watch the coordinator's heartbeats for engines held for
        weights, and catch them up from a thread of their own."""
        c = self.cluster
        if c.snapshot is None or c.sync is None or self._thread is not None:
            return

        def heard(membership: dict) -> None:
            if any(isinstance(e, list) and len(e) == 3 and e[2] for e in membership["engines"]):
                self._wanted.set()

        c.client.membership_callbacks.append(heard)
        self._thread = threading.Thread(target=self._catch_up_loop, name="rollout-catch-up",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _catch_up_loop(self) -> None:
        failures = 0
        while True:
            self._wanted.wait()
            if self._closing.is_set():
                return
            self._wanted.clear()
            try:
                self.catch_up()
                failures = 0
            except Exception as e:  # the engine stays held; the next heartbeat names it again
                if self._closing.is_set():
                    return
                failures += 1
                delay = min(CATCH_UP_BACKOFF_S[1], CATCH_UP_BACKOFF_S[0] * 2 ** (failures - 1))
                log.warning("catching up joined engines failed (%s); again in %.0fs", e, delay)
                if self._closing.wait(delay):
                    return

    def catch_up(self) -> dict[int, dict]:
        """Send every engine the coordinator holds for weights (joined, or back, after the last
        update) the version the others serve, from the snapshot. Serialised with updates;
        returns their acks ({} when none is held, before the first update, or when the
        coordinator announced another version)."""
        c = self.cluster
        with self.lock:
            stats = c.stats()
            held = sorted((int(r), int(e["engine_id"])) for r, e in stats["engines"].items()
                          if e["syncing"] and not e["stopped"])  # fmt: skip
            snap = c.snapshot.state_dict() if held and c.snapshot is not None else None
            if snap is None or snap[0] != stats["weight_version"]:
                return {}
            version, sd = snap
            infos = self.push_to_survivors(sd, version, held, None)
        self.last_catch_up = infos
        self.counters["engines_caught_up"] += len(infos)
        for rank, info in infos.items():
            c.event("caught_up", rank, info)
        return infos

    def stop(self, timeout_s: float) -> None:
        """End the catch-up thread (a catch-up in flight finishes or fails first)."""
        self._closing.set()
        self._wanted.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def check_agreement(infos: dict[int, dict], version: int, own: int | None) -> None:
    """Every ack names `version`, received exactly what the trainer sent (`own`: its digest of
    the transfer) and holds one checksum, else WeightSyncError naming the engines."""
    bad = {r: i for r, i in infos.items() if i.get("weight_version") != version}
    if bad:
        raise WeightSyncError(f"engines did not apply version {version}: {bad}")
    forged = sorted(int(r) for r, i in infos.items() if i.get("received") != own)
    if forged:
        raise WeightSyncError(f"engine ranks {forged} report weights for version {version} that "
                              f"are not the trainer's (digest {own}): "
                              f"{ {r: infos[r].get('received') for r in forged} }")  # fmt: skip
    sums = {i.get("checksum") for i in infos.values()}
    if len(sums) > 1:
        raise WeightSyncError(f"engines disagree on the weights of version {version}: {infos}")


async def _awaited(make: Callable[[], Any]) -> Any:
    return await make()
