"""Who may publish weights: MACs keyed by the coordinator's shared secret.

The weight-sync store (a torch TCPStore) and the shared memory of colocated updates have no
authentication of their own: any local process can write their keys and bytes. So nothing an
engine reads from them is trusted by itself. Everything that decides what an engine applies --
the update's announcement (version, store, generation, backend, members, the ipc manifest), the
broadcast's per-bucket checksums, an abort, the committed version -- carries an HMAC-SHA256
made with a key derived from the coordinator's secret, which only the trainer and the engines
hold. An engine verifies before it acts; without the key (a coordinator started with
`allow_unauthenticated=True`) there is nothing to verify with and the weight path is
unauthenticated as well (the trainer then keeps its store on loopback).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

import msgpack

_KEY_LABEL = b"rollout weight-sync key v1"  # the key is never the token itself


def weight_key(token: str | None) -> bytes | None:
    """The weight path's MAC key for the coordinator secret `token`; None without one."""
    if token is None:
        return None
    return hmac.new(token.encode(), _KEY_LABEL, hashlib.sha256).digest()


def sign(key: bytes | None, purpose: str, fields: Sequence) -> bytes:
    """HMAC-SHA256 of (purpose, fields) msgpack-encoded; b"" without a key. `purpose` keeps a
    MAC made for one message from being accepted as another."""
    if key is None:
        return b""
    return hmac.new(key, msgpack.packb([purpose, *fields]), hashlib.sha256).digest()


def verify(key: bytes | None, purpose: str, fields: Sequence, tag: object) -> bool:
    """`tag` is sign(key, purpose, fields) (constant time); always True without a key."""
    if key is None:
        return True
    return isinstance(tag, bytes) and hmac.compare_digest(tag, sign(key, purpose, fields))


def digest(data: bytes | None) -> bytes:
    """SHA-256 of `data` (b"" for None): what a MAC covers in place of a large payload."""
    return b"" if data is None else hashlib.sha256(data).digest()


def nonce() -> str:
    """A random tag that makes a name unguessable (generation ids, a store's identity)."""
    return secrets.token_hex(8)
