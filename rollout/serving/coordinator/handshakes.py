"""The coordinator's handshakes: which peers it admits, and as what.

A client's CONNECT and an engine's ENGINE_REGISTER carry the shared secret, checked by
`Admission` (rollout.serving.coordinator.admission: failed handshakes are remembered per peer
and refusals rate-limited). A registering engine must also serve the service's model
(rollout.serving.model_identity: names, shapes, dtypes, and the weights' digest while no trainer
pushes weights); once a trainer pushes weights, an engine whose version is only a label, or
another version, is held out of routing (`syncing`) until it has received the current ones.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from rollout.protocol import Headers, encode
from rollout.serving.coordinator.peers import ClientPeer, EnginePeer
from rollout.serving.coordinator.state import CoordinatorState
from rollout.serving.model_identity import refusal, summary

if TYPE_CHECKING:
    from rollout.serving.coordinator.coordinator import DataParallelInferenceCoordinator

log = logging.getLogger(__name__)


class Handshakes:
    """CONNECT and ENGINE_REGISTER for one coordinator; numbers its peers."""

    def __init__(self, coord: DataParallelInferenceCoordinator) -> None:
        self.coord = coord
        self.next_peer = 0

    def refuse(self, identity: bytes, header: Headers, kind: str, message: str) -> None:
        """ERROR to a peer that is not (or no longer) admitted, within the refusal rate limit."""
        c = self.coord
        if c.admission.may_refuse(kind):
            c._error(identity, header, None, message)
        else:
            c.counters["refusals_unanswered"] += 1

    def _auth_ok(self, identity: bytes, header: Headers, token) -> bool:
        c = self.coord
        if c.admission.check(identity, token):
            return True
        c.counters["auth_failures"] += 1
        self.refuse(identity, header, "auth", "authentication failed: bad or missing auth token")
        return False

    def connect(self, identity: bytes, fields: list) -> None:
        c = self.coord
        if not self._auth_ok(identity, Headers.CONNECT, fields[0]):
            return
        client = c.clients.get(identity)
        if client is None:
            self.next_peer += 1
            client = ClientPeer(identity, self.next_peer, time.monotonic())
            c.clients[identity] = client
            c.counters["clients_connected"] += 1
        live = sum(not e.stopped for e in c.engines.values())
        ack = encode(Headers.CONNECT_ACK, client.client_id, live, c.config.heartbeat_s,
                     c.config.max_frame_bytes)  # fmt: skip
        c._send(identity, ack)

    def register(self, identity: bytes, fields: list) -> None:
        c = self.coord
        rank, capacity, version, token, block_size, model, version_is_label = fields
        if not self._auth_ok(identity, Headers.ENGINE_REGISTER, token):
            return
        misfit = refusal(model, c.model, c.weights_managed)
        if misfit is not None:
            c.counters["engines_refused_model"] += 1
            log.warning("engine rank %d refused: %s", rank, misfit)
            c._error(identity, Headers.ENGINE_REGISTER, None, misfit)
            return
        if rank < 0 or capacity < 0 or block_size < 1:
            c._error(
                identity,
                Headers.ENGINE_REGISTER,
                None,
                f"invalid registration: rank={rank} capacity={capacity} block_size={block_size}",
            )
            return
        if c.state is CoordinatorState.STOPPING:
            c._error(identity, Headers.ENGINE_REGISTER, None, "coordinator is stopping")
            return
        self.next_peer += 1
        engine = EnginePeer(identity, self.next_peer, rank, capacity, version, block_size, 0.0)
        engine.last_seen = time.monotonic()
        c.engines[identity] = engine
        if c.model is None:
            c.model = model
            log.info("service model: %s", summary(model))
        # a label on checkpoint weights says nothing once a trainer pushes weights
        engine.syncing = c.weights_managed and (version_is_label or version != c.weight_version)
        if engine.syncing:
            c.counters["engines_held_for_weights"] += 1
        else:
            c.router.add_engine(identity, rank)
        if c.request_path.block_size is None:
            c.request_path.block_size = block_size
        if c.weight_version is None:
            c.weight_version = version
        c.counters["engines_registered"] += 1
        ack = encode(
            Headers.ENGINE_REGISTER_ACK,
            engine.engine_id,
            c.config.heartbeat_s,
            c.state.value,
            c.weight_version,
            c.config.max_frame_bytes,
        )
        if c._send_engine(engine, ack) and not engine.syncing:
            c._dispatch_orphans()
        c._announce_membership()
