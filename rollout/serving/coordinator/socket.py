"""The coordinator's ROUTER socket: its options, CURVE and its ZAP gate, its address.

Sends never block or drop silently (no high-water marks; an unreachable peer is an error), and
zmq refuses a frame over `max_frame_bytes` from its size header, dropping that connection
before buffering it: a peer cannot make the coordinator hold a huge frame it trickles in.
Beyond loopback (or when asked) the socket is a CURVE server keyed by the secret, and strangers
fail ZeroMQ's handshake at the ZAP gate (rollout.serving.curve) before any frame of theirs is
read; the loop answers the gate's requests as they come (`RouterSocket.answer_zap`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import zmq

from rollout.serving.coordinator.config import CoordinatorConfig
from rollout.serving.curve import ZapGate, secure_router, server_uses_curve


@dataclass
class RouterSocket:
    ctx: zmq.Context
    socket: zmq.Socket
    address: str
    zap: ZapGate | None  # CURVE's handshake gate; None without CURVE

    @property
    def curve(self) -> bool:
        return self.zap is not None

    def poller(self) -> zmq.Poller:
        """One Poller for the loop (Socket.poll builds a new one per call): the socket and,
        with CURVE, the gate whose verdicts handshakes wait for."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        if self.zap is not None:
            poller.register(self.zap.socket, zmq.POLLIN)
        return poller

    def answer_zap(self) -> None:
        if self.zap is not None:
            self.zap.answer()

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()


def open_router(cfg: CoordinatorConfig, token: str | None, counters: Counter) -> RouterSocket:
    """The bound ROUTER for `cfg` (port 0: a random free one); `counters` count the gate's
    refusals."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unreachable peer -> error, not drop
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
    use_curve = server_uses_curve(cfg.host, token, cfg.curve)
    zap = secure_router(sock, token, counters) if use_curve else None
    if cfg.port:
        sock.bind(f"tcp://{cfg.host}:{cfg.port}")
        port = cfg.port
    else:
        port = sock.bind_to_random_port(f"tcp://{cfg.host}")
    return RouterSocket(ctx, sock, f"tcp://{cfg.host}:{port}", zap)
