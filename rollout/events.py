"""Request status and lifecycle events (what happened to a request, and when)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from rollout.codecs import check_msgpack_native


class Status(enum.Enum):
    WAITING_IN_QUEUE = 1
    ACTIVE_AND_GENERATING_TOKENS = 2
    ACTIVE_BUT_NOT_GENERATING_TOKENS = 3
    COMPLETED = 4
    FAILED = 5


class DynamicInferenceEventType(enum.Enum):
    ADD_ENGINE = enum.auto()
    ADD_CONTEXT = enum.auto()
    GENERATED_TOKEN = enum.auto()
    PAUSE = enum.auto()
    EVICT = enum.auto()
    FINISH = enum.auto()
    FAIL = enum.auto()
    ERROR_TRANSIENT = enum.auto()
    ERROR_NONTRANSIENT = enum.auto()


ERROR_EVENT_TYPES = (
    DynamicInferenceEventType.ERROR_TRANSIENT,
    DynamicInferenceEventType.ERROR_NONTRANSIENT,
)
_ERROR_KEYS = {"type", "message", "is_transient"}
STATUS_BY_NAME = {s.name: s for s in Status}
_EVENT_BY_NAME = {t.name: t for t in DynamicInferenceEventType}


@dataclass
class DynamicInferenceEvent:
    """A timestamped lifecycle event; the payload must be msgpack-native so it round-trips exactly."""

    type: DynamicInferenceEventType
    timestamp: float | None = None
    payload: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.type, DynamicInferenceEventType):
            raise ValueError(f"event type must be a DynamicInferenceEventType, got {self.type!r}")
        if self.timestamp is None:
            self.timestamp = time.time()
        self.timestamp = float(self.timestamp)
        check_msgpack_native(self.payload, f"{self.type.name} event payload")
        if self.type in ERROR_EVENT_TYPES and (
            not isinstance(self.payload, dict) or not self.payload.keys() >= _ERROR_KEYS
        ):
            raise ValueError(f"{self.type.name} payload needs keys {sorted(_ERROR_KEYS)}")

    def __str__(self) -> str:
        return f"[{self.timestamp:.6f}] {self.type.name}" + (
            "" if self.payload is None else f" {self.payload}"
        )

    def serialize(self) -> dict[str, Any]:
        return {"type": self.type.name, "timestamp": self.timestamp, "payload": self.payload}

    @classmethod
    def deserialize(cls, obj: dict[str, Any]) -> DynamicInferenceEvent:
        try:
            kind = _EVENT_BY_NAME[obj["type"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad event {obj!r}: {e}") from None
        ts, payload = obj.get("timestamp"), obj.get("payload")
        if type(ts) is not float or kind in ERROR_EVENT_TYPES:
            return cls(kind, ts, payload)  # the general path: validates and normalises
        check_msgpack_native(payload, f"{kind.name} event payload")
        event = object.__new__(cls)  # what __init__ would set, without the dataclass overhead
        event.type, event.timestamp, event.payload = kind, ts, payload
        return event
