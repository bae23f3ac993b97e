"""CURVE: encrypted, mutually authenticated coordinator links, keyed by the shared secret.

Without it the secret, prompts, completions and log-probs cross the network in clear text, and
anyone who sees one CONNECT can join. With it, every byte between peer and coordinator is
encrypted (ZeroMQ CURVE: Curve25519 + XSalsa20-Poly1305), and a peer that does not hold the secret
is refused during ZeroMQ's handshake, before any message of its reaches the coordinator.

Keys come from the token files users already manage: both keypairs are derived from the secret
(scrypt, then HMAC per role), so holding the token is what lets a peer connect, and nothing else
needs distributing. The coordinator holds the server keypair and accepts only the derived client
public key (`ZapGate`, the ZAP handler it polls in its own loop); clients and engines share the
client keypair and know the server's public key, so they also know they reached a coordinator
that holds the secret. scrypt makes each guess of a weak user-chosen secret against a recorded
handshake cost ~50 ms; the generated secrets (256 bits) need no such help.

When: the coordinator speaks CURVE whenever it binds any address other than 127.0.0.1, ::1 or
localhost (0.0.0.0 included), unless told `curve=False`; `curve=True` forces it on loopback too.
A peer connecting to a non-loopback address always speaks CURVE (never falls back to clear text:
no downgrade). A peer connecting to a loopback address tries clear text and switches to CURVE when
the coordinator answers that it speaks CURVE (a trainer on the coordinator's own host reaching
`rollout serve --host 0.0.0.0` through 127.0.0.1): loopback traffic never leaves the host.
With no secret at all (`allow_unauthenticated`) there is nothing to key CURVE with: it stays off
(`curve=True` is then an error). Where no `curve` argument is given, $ROLLOUT_CURVE (on | off |
auto) decides, so one setting reaches every process of a deployment (`rollout serve --curve`
sets it for its engines and HTTP front end).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

ENV_CURVE = "ROLLOUT_CURVE"
_ENV_VALUES = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False,
               "auto": None, "": None}  # fmt: skip
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks its context's ZAP handler (RFC 27)
ZAP_DOMAIN = b"rollout"
_SALT = b"rollout CURVE keys v1"


class CurveUnavailable(RuntimeError):
    """CURVE was asked for but this libzmq was built without it."""


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded Curve25519 keypairs of the two roles (40 bytes each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@functools.lru_cache(maxsize=8)
def curve_keys(token: str) -> CurveKeys:
    """The keypairs every holder of `token` derives alike (cached: scrypt costs ~50 ms)."""
    master = hashlib.scrypt(token.encode(), salt=_SALT, n=1 << 14, r=8, p=1, dklen=32)
    keys = {}
    for role in ("server", "client"):
        secret = z85.encode(hmac.new(master, role.encode(), hashlib.sha256).digest())
        keys[f"{role}_secret"] = secret
        keys[f"{role}_public"] = zmq.curve_public(secret)
    return CurveKeys(**keys)


def host_of(address: str) -> str:
    """The host of a `tcp://HOST:PORT` address (IPv6 brackets removed)."""
    hostport = address.split("://", 1)[-1]
    host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """127.0.0.1, ::1 or localhost exactly: any other address (0.0.0.0, 127.0.0.2, a name) may be
    reachable from elsewhere, or is meant to be."""
    return host.strip("[]") in LOOPBACK_HOSTS


def resolve_curve(curve: bool | None) -> bool | None:
    """`curve` if given, else $ROLLOUT_CURVE's word: True / False, or None (by address)."""
    if curve is not None:
        if not isinstance(curve, bool):
            raise ValueError(f"curve must be True, False or None (by address), got {curve!r}")
        return curve
    word = os.environ.get(ENV_CURVE, "").strip().lower()
    if word not in _ENV_VALUES:
        raise ValueError(f"${ENV_CURVE} must be on, off or auto, got {word!r}")
    return _ENV_VALUES[word]


def _require_curve(what: str) -> None:
    if not zmq.has("curve"):
        raise CurveUnavailable(
            f"{what} needs ZeroMQ CURVE, which this libzmq lacks (pyzmq wheels include it)"
        )


def server_uses_curve(host: str, token: str | None, curve: bool | None) -> bool:
    """Whether a coordinator bound to `host` speaks CURVE (`curve`: None = by address)."""
    curve = resolve_curve(curve)
    wanted = not is_loopback(host) if curve is None else curve
    if not wanted:
        if not is_loopback(host):
            log.warning("coordinator on %s without CURVE: secret and prompts cross the network "
                        "in clear text", host)  # fmt: skip
        return False
    if token is None:
        if curve:
            raise ValueError("curve=True needs a shared secret (auth_token), which "
                             "allow_unauthenticated=True removes")  # fmt: skip
        log.warning("coordinator on %s without a secret: no CURVE encryption either", host)
        return False
    _require_curve("curve")
    return True


class ZapGate:
    """The coordinator's ZAP handler: admits CURVE clients holding the derived client key and
    nothing else. Bound in the coordinator's context before its ROUTER binds; the coordinator
    polls `socket` in its loop and calls `answer()` (no thread)."""

    def __init__(self, ctx: zmq.Context, client_public: bytes, counters: dict) -> None:
        self.allowed = z85.decode(client_public)
        self.counters = counters
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)

    def answer(self) -> None:
        """Reply to every handshake waiting for a verdict (non-blocking)."""
        while True:
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._verdict(request))

    def _verdict(self, request: list[bytes]) -> list[bytes]:
        version, request_id = [*request, b"", b""][:2]
        mechanism, credentials = request[5:6], request[6:]
        ok = (
            len(request) == 7
            and mechanism == [b"CURVE"]
            and hmac.compare_digest(credentials[0], self.allowed)
        )
        self.counters["curve_admitted" if ok else "curve_refused"] += 1
        status = (b"200", b"OK") if ok else (b"400", b"peer does not hold the secret")
        return [version or b"1.0", request_id, *status, b"", b""]

    def close(self) -> None:
        self.socket.close(linger=0)


def secure_router(sock: zmq.Socket, token: str, counters: dict) -> ZapGate:
    """Make `sock` (not yet bound) a CURVE server keyed by `token`; its ZAP gate."""
    keys = curve_keys(token)
    gate = ZapGate(sock.context, keys.client_public, counters)
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.zap_domain = ZAP_DOMAIN
    return gate


def _secure_dealer(sock: zmq.Socket, token: str) -> None:
    keys = curve_keys(token)
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


def _new_dealer(ctx: zmq.Context, token: str | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if token is not None:
        _secure_dealer(sock, token)
    return sock


def connect_dealer(
    ctx: zmq.Context, address: str, token: str | None, curve: bool | None, probe_s: float
) -> tuple[zmq.Socket, bool]:
    """A DEALER connected to the coordinator at `address`, and whether it speaks CURVE.

    `curve`: True/False force it; None chooses by address: CURVE beyond loopback, and on
    loopback clear text unless the coordinator turns out to speak CURVE (waits up to `probe_s`
    for ZeroMQ's handshake to tell; a coordinator not up yet is taken as clear text)."""
    curve = resolve_curve(curve)
    if curve or (curve is None and not is_loopback(host_of(address)) and token is not None):
        if token is None:
            raise ValueError("curve=True needs the coordinator's secret (auth_token)")
        _require_curve("curve")
        sock = _new_dealer(ctx, token)
        sock.connect(address)
        return sock, True
    sock = _new_dealer(ctx, None)
    if curve is False or token is None or not zmq.has("curve"):
        sock.connect(address)
        return sock, False
    if _speaks_curve(sock, address, probe_s):
        sock.close(linger=0)
        sock = _new_dealer(ctx, token)
        sock.connect(address)
        return sock, True
    return sock, False


def _speaks_curve(sock: zmq.Socket, address: str, timeout_s: float) -> bool:
    """Connect `sock` (clear text) and wait for the handshake's outcome: True when the peer
    refused it for speaking another mechanism (CURVE: the only other one we use)."""
    events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    monitor = sock.get_monitor_socket(events)
    try:
        sock.connect(address)
        if not monitor.poll(int(timeout_s * 1000)):
            return False
        event = recv_monitor_message(monitor)
        return (
            event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        )
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
