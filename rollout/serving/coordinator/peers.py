"""What the coordinator remembers about its peers and the work in flight between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.protocol import Headers


@dataclass(slots=True)
class EnginePeer:
    identity: bytes
    engine_id: int
    rank: int
    capacity: int
    weight_version: int
    block_size: int
    last_seen: float
    load: dict = field(default_factory=dict)
    requests: set[int] = field(default_factory=set)
    stopped: bool = False
    # Joined with other weights than the trainer's current version: it takes no work until it
    # acks a SET_WEIGHT_VERSION of the current version (the trainer's next update reaches it).
    syncing: bool = False
    dispatched: int = 0  # requests routed here (re-dispatches included)
    # Requests we aborted here and forgot, until the engine's final reply for each comes back:
    # until then its heartbeats may predate the abort, so their load is not published.
    aborting: set[int] = field(default_factory=set)


@dataclass(slots=True)
class ClientPeer:
    identity: bytes
    client_id: int
    last_seen: float
    requests: dict[int, int] = field(default_factory=dict)  # client request id -> server id


@dataclass(slots=True)
class Pending:
    """A request between submission and final reply; enough to re-dispatch it elsewhere."""

    request_id: int
    client: bytes
    client_request_id: int
    prompt: str | bytes
    sampling_params: bytes
    num_tokens: int
    prompt_len: int
    hashes: list[int]
    packed_hashes: bytes
    stream: bool
    affinity: int | None = None  # routing-only key when there is no block hash; never forwarded
    routing_key: str | None = None  # the client's sticky key (an episode): same key, same engine
    engine: bytes | None = None
    reserved: int = 0  # tokens reserved on the router for the current engine
    resume_tokens: bytearray = field(default_factory=bytearray)  # streamed so far (int32 LE)
    resume_log_probs: bytearray = field(default_factory=bytearray)  # (float64 LE)
    # the weight version that sampled each streamed token (int64 LE): a resumed token keeps it
    resume_versions: bytearray = field(default_factory=bytearray)
    # routing replay: the streamed experts rows (opaque here; rollout.serving.resume reads them)
    resume_experts: bytearray = field(default_factory=bytearray)
    dispatches: int = 0
    crashes: int = 0  # engines that died (or left) while holding it
    deadline: float | None = None  # set while waiting for an engine


@dataclass(slots=True)
class PendingControl:
    client: bytes
    client_control_id: int
    signal: Headers
    waiting: set[bytes]
    info: dict = field(default_factory=dict)
    carries_weights: bool = False  # a SET_WEIGHT_VERSION with a rendezvous: weights, not a label
