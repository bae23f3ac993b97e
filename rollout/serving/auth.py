"""Shared-secret tokens that coordinator peers (engines and clients) present when they join.

A token is never required on a command line (where every user of the machine can read it):
it comes from an explicit value, a file, or the environment. `tokens_match` compares in
constant time so a peer cannot learn the token byte by byte from response timing.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

ENV_TOKEN = "ROLLOUT_AUTH_TOKEN"
ENV_TOKEN_FILE = "ROLLOUT_AUTH_TOKEN_FILE"
MAX_TOKEN_CHARS = 1024  # a CONNECT with a longer token is refused before it is compared


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def read_token_file(path: str | os.PathLike) -> str:
    """The token stored in `path` (surrounding whitespace ignored); ValueError if it is empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read auth token file {str(path)!r}: {e}") from None
    if not token:
        raise ValueError(f"auth token file {str(path)!r} is empty")
    return token


def resolve_token(
    token: str | None = None, token_file: str | os.PathLike | None = None
) -> str | None:
    """The token to use: explicit value > file > $ROLLOUT_AUTH_TOKEN > $ROLLOUT_AUTH_TOKEN_FILE;
    None when none of them is set."""
    if token is not None:
        if not isinstance(token, str) or not token:
            raise ValueError("auth_token must be a non-empty str")
        return token
    if token_file is not None:
        return read_token_file(token_file)
    env = os.environ.get(ENV_TOKEN)
    if env:
        return env
    env_file = os.environ.get(ENV_TOKEN_FILE)
    if env_file:
        return read_token_file(env_file)
    return None


def tokens_match(given: object, expected: str) -> bool:
    """Constant-time comparison; anything but a str of sane length is a mismatch."""
    if type(given) is not str or len(given) > MAX_TOKEN_CHARS:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())
