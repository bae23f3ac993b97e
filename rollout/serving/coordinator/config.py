"""CoordinatorConfig: the coordinator's settings, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.protocol import MAX_FRAME_BYTES
from rollout.serving.coordinator.routing import POLICIES


@dataclass
class CoordinatorConfig:
    """Everything the coordinator process needs; plain values so it crosses process boundaries."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    policy: str = "load_balanced"
    alpha: float = 0.5  # prefix policies: weight of cache match vs load
    block_size: int | None = None  # prefix hashing block size; None: the first engine's
    max_hash_entries: int = 1 << 20
    deterministic: bool = False
    schedule_output_path: str | None = None
    # Peers must present this secret. None: $ROLLOUT_AUTH_TOKEN / $ROLLOUT_AUTH_TOKEN_FILE, else
    # the coordinator generates one (its `auth_token`, reported by `entrypoint`).
    auth_token: str | None = None
    auth_token_file: str | None = None
    # No secret at all: for trusted single-user setups and tests only (any local process could
    # otherwise register as an engine and read or forge other users' requests).
    allow_unauthenticated: bool = False
    # Encrypt and authenticate every link with CURVE keyed by the secret (rollout.serving.curve).
    # None: $ROLLOUT_CURVE, else on whenever `host` is not 127.0.0.1 / ::1 / localhost.
    curve: bool | None = None
    max_auth_failures_per_peer: int = 3  # then the peer is ignored (no reply, not decoded)
    refusals_per_s: float = 50.0  # answers to failed or unknown peers, all of them together
    heartbeat_s: float = 1.0
    engine_timeout_s: float = 10.0  # silent this long -> engine presumed dead
    client_timeout_s: float = 30.0  # silent this long -> client presumed gone
    engine_wait_s: float = 30.0  # requests wait this long for an engine when none is live
    # A request held by this many engines when they died is failed ("request crashed N
    # engines") instead of re-dispatched: one poisonous request takes down at most N engines.
    max_engine_crashes: int = 2
    max_frame_bytes: int = MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        for name in ("heartbeat_s", "engine_timeout_s", "client_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_auth_failures_per_peer < 1 or self.refusals_per_s <= 0:
            raise ValueError("max_auth_failures_per_peer must be >= 1 and refusals_per_s > 0")
        if self.max_engine_crashes < 1:
            raise ValueError(f"max_engine_crashes must be >= 1, got {self.max_engine_crashes!r}")
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {self.max_frame_bytes!r}")
        if self.allow_unauthenticated and (self.auth_token or self.auth_token_file):
            raise ValueError("allow_unauthenticated=True contradicts a given auth_token")
        if self.engine_wait_s < 0:
            raise ValueError(f"engine_wait_s must be >= 0, got {self.engine_wait_s!r}")
        if self.engine_timeout_s <= self.heartbeat_s:
            raise ValueError(
                f"engine_timeout_s ({self.engine_timeout_s}) must exceed heartbeat_s "
                f"({self.heartbeat_s})"
            )
