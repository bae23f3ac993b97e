"""Admission: what the coordinator does with frames from peers that have not authenticated.

Such a peer may only send the small CONNECT / ENGINE_REGISTER handshake, so anything larger is
dropped before it is decoded (a flood of big garbage frames costs a length check each). Failed
handshakes are rate-limited: a peer identity that failed `max_failures_per_peer` times is
ignored from then on, and refusals leave at most at `refusals_per_s` overall, so guessing
tokens or provoking replies gains an attacker nothing. Failed handshakes and "unknown peer"
notices (which tell a forgotten engine or client to join again) have a budget each, so a
guessing flood does not silence the notices.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from rollout.serving.auth import tokens_match

MAX_HANDSHAKE_BYTES = 4096  # CONNECT / ENGINE_REGISTER with a token fit easily


class TokenBucket:
    """`rate` events per second on average, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.level = burst
        self.stamp = clock()

    def take(self) -> bool:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True


class Admission:
    """Screens unauthenticated frames and checks handshake tokens (None: auth is off)."""

    def __init__(
        self,
        token: str | None,
        max_failures_per_peer: int = 3,
        refusals_per_s: float = 50.0,
        max_tracked_peers: int = 65536,
    ):
        self.token = token
        self.max_failures_per_peer = max_failures_per_peer
        burst = max(1.0, 2.0 * refusals_per_s)
        self.refusals = {
            "auth": TokenBucket(refusals_per_s, burst),
            "unknown": TokenBucket(refusals_per_s, burst),
        }
        self.max_tracked_peers = max_tracked_peers
        self.failures: OrderedDict[bytes, int] = OrderedDict()  # identity -> failed handshakes

    def screen(self, identity: bytes, frame: bytes) -> str | None:
        """Why a frame from an unauthenticated peer is dropped undecoded, or None to decode it."""
        if self.failures.get(identity, 0) >= self.max_failures_per_peer:
            return "banned_peer_frames"
        if len(frame) > MAX_HANDSHAKE_BYTES:
            return "unauthenticated_oversize"
        return None

    def check(self, identity: bytes, token: object) -> bool:
        """Does `token` authenticate this peer? A failure is remembered against its identity."""
        if self.token is None or tokens_match(token, self.token):
            self.failures.pop(identity, None)
            return True
        self.failures[identity] = self.failures.pop(identity, 0) + 1
        if len(self.failures) > self.max_tracked_peers:
            self.failures.popitem(last=False)  # forget the oldest offender
        return False

    def may_refuse(self, kind: str) -> bool:
        """Whether a refusal of this kind ("auth" | "unknown") may be sent now; the rest are
        dropped silently (and counted by the caller)."""
        return self.refusals[kind].take()
