"""The wire: message headers, one schema table, and a codec that rejects anything malformed.

Every message is ONE msgpack frame `[header, *fields]` on a ZMQ ROUTER (coordinator) <-> DEALER
(clients, engines) link. `decode` checks size, msgpack validity, the header and each field's type
against `SCHEMA`, and raises only `ProtocolError`, so the coordinator can count and answer bad
input instead of crashing on it. No pickle anywhere.

Payloads the coordinator does not need (request records, sampling params, top-n log-probs) travel
as opaque `bytes` fields: it decodes only the small header and ids and forwards the rest. Token ids
travel as packed int32 bytes (`pack_tokens`), which costs a few microseconds instead of tens for a
msgpack list of Python ints.

A re-dispatched request carries its checkpoint: the tokens, log-probs and per-token weight
versions (packed int64, `pack_versions`) its lost engine streamed, so the engine that resumes it
stamps each token with the version that really sampled it. First dispatches carry empty bytes.

Message catalogue (C = client, Co = coordinator, E = engine); `SCHEMA` is authoritative:

    CONNECT            C->Co   [auth_token]      CONNECT_ACK   Co->C [client_id, num_engines, heartbeat_s, max_frame_bytes]
    ENGINE_REGISTER    E->Co   [rank, capacity, weight_version, auth_token, block_size, model(identity dict),
                                version_is_label(bool: its weights did not come through the weight path)]
    ENGINE_REGISTER_ACK Co->E  [engine_id, heartbeat_s, state, weight_version, max_frame_bytes]
    SUBMIT_REQUEST     C->Co   [client_request_id, prompt(str | packed tokens), sampling_params(msgpack bytes),
                                num_tokens_to_generate, stream, routing_key(str | None),
                                cache_salt(str | None: a copy of sampling_params.cache_salt, so the
                                coordinator hashes the prompt as the engine will without opening them)]
    DISPATCH_REQUEST   Co->E   [request_id, prompt, sampling_params, block_hashes(packed int64),
                                resume_tokens(packed int32), resume_log_probs(packed float64),
                                resume_weight_versions(packed int64), stream,
                                resume_routed_experts(packed rows)]
    SUBMIT_BATCH       C->Co   [[[client_request_id, prompt, sampling_params, num_tokens_to_generate,
                                stream, routing_key, cache_salt], ...]]   (SUBMIT_REQUESTs of one loop turn, one frame)
    DISPATCH_BATCH     Co->E   [[[DISPATCH_REQUEST fields], ...]]  (one SUBMIT_BATCH's rows per engine)
    REPLY              E->Co, Co->C   [[[id, record_bytes], ...]]           (batched per step)
    REPLY_PARTIAL      E->Co, Co->C   [[[id, new_tokens, new_log_probs, new_weight_versions, extra,
                                new_routed_experts], ...]]   (routing replay's rows, `pack_experts`, or None)
    ABORT_REQUEST      C->Co, Co->E   [id]
    PAUSE/UNPAUSE/RESUME/STOP  C->Co->E  [control_id]
    SUSPEND            C->Co->E  [control_id, mode, weights(keep | offload | discard: vLLM's sleep levels
                               1 and 2 for the weights; rollout.engine.weights_residency)]
    SET_WEIGHT_VERSION C->Co->E  [control_id, version, rendezvous({host, port, timeout_s} | None)]
                               (rendezvous: where the trainer's weight-sync store listens; an
                               engine started without one joins the sync group from it)
    CONTROL_ACK        E->Co, Co->C   [control_id, signal, info(dict)]
    ERROR              Co->C/E  [ref_header | None, ref_id | None, message]
    HEARTBEAT          any      [load(dict)]   (engines publish waiting/running/kv_usage/outstanding_tokens;
                               to clients the coordinator sends its membership: {engines:
                               [[rank, engine id, syncing]], weight_version})
    KV_EVENTS          E->Co    [evicted_hashes(packed int64), reset]
    STATS              C->Co    [stats_id]      STATS_REPLY Co->C [stats_id, stats(dict)]
    DISCONNECT         C/E->Co  []
    SHUTDOWN           C->Co, Co->E  []
"""

from __future__ import annotations

import struct
import sys
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np

MAX_FRAME_BYTES = 64 * 1024 * 1024  # default cap; decode() takes a per-call override
# Elements (array items + map entries + containers) one frame may decode to. A legitimate frame
# is mostly opaque bytes (its biggest lists are MAX_BATCH_ROWS-row batches), but 15 MB of
# empty maps would decode to 15 million dicts: decoding stops at this budget instead.
MAX_FRAME_ELEMENTS = 1 << 18


class ProtocolError(ValueError):
    """Any malformed frame: bad msgpack, unknown header, wrong arity or field type, oversize."""


class Headers(IntEnum):
    # connection
    CONNECT = 0
    CONNECT_ACK = 1
    ENGINE_REGISTER = 2
    ENGINE_REGISTER_ACK = 3
    # requests
    SUBMIT_REQUEST = 20
    DISPATCH_REQUEST = 21
    REPLY = 22
    REPLY_PARTIAL = 23
    ABORT_REQUEST = 24
    SUBMIT_BATCH = 25
    DISPATCH_BATCH = 26
    # control (broadcast to engines and acknowledged)
    PAUSE = 40
    UNPAUSE = 41
    SUSPEND = 42
    RESUME = 43
    STOP = 44
    SET_WEIGHT_VERSION = 45
    CONTROL_ACK = 46
    # status
    ERROR = 60
    HEARTBEAT = 61
    KV_EVENTS = 62
    STATS = 63
    STATS_REPLY = 64
    # lifecycle
    DISCONNECT = 80
    SHUTDOWN = 81


SUSPEND_MODES = ("persist", "offload", "recompute")  # SUSPEND's mode: what happens to the KV cache
WEIGHT_MODES = ("keep", "offload", "discard")  # SUSPEND's weights: what happens to the weights

CONTROL_HEADERS = frozenset(
    {
        Headers.PAUSE,
        Headers.UNPAUSE,
        Headers.SUSPEND,
        Headers.RESUME,
        Headers.STOP,
        Headers.SET_WEIGHT_VERSION,
    }
)


class Rows:
    """Field type for a list of fixed-shape rows (batched replies): each row is checked too."""

    __slots__ = ("fields",)

    def __init__(self, *fields: tuple[str, tuple[type, ...]]):
        self.fields = fields

    def __repr__(self) -> str:
        return "list of [" + ", ".join(n for n, _ in self.fields) + "]"


INT = (int,)
STR = (str,)
BYTES = (bytes,)
BOOL = (bool,)
DICT = (dict,)
NUM = (int, float)
OPT_INT = (int, type(None))
OPT_STR = (str, type(None))
OPT_BYTES = (bytes, type(None))
OPT_DICT = (dict, type(None))
PROMPT = (str, bytes)

_CONTROL = (("control_id", INT),)
_SUBMIT_FIELDS = (
    ("client_request_id", INT),
    ("prompt", PROMPT),
    ("sampling_params", BYTES),
    ("num_tokens_to_generate", INT),
    ("stream", BOOL),
    ("routing_key", OPT_STR),  # requests with one key stay on one engine (an episode's turns)
    ("cache_salt", OPT_STR),  # sampling_params.cache_salt: prefix hashes start from its root
)
MAX_ROUTING_KEY_CHARS = 256
_DISPATCH_FIELDS = (
    ("request_id", INT),
    ("prompt", PROMPT),
    ("sampling_params", BYTES),
    ("block_hashes", BYTES),
    ("resume_tokens", BYTES),
    ("resume_log_probs", BYTES),
    ("resume_weight_versions", BYTES),
    ("stream", BOOL),
    ("resume_routed_experts", BYTES),  # routing replay: the streamed experts rows, or b""
)

SCHEMA: dict[Headers, tuple[tuple[str, Any], ...]] = {
    Headers.CONNECT: (("auth_token", OPT_STR),),
    Headers.CONNECT_ACK: (
        ("client_id", INT),
        ("num_engines", INT),
        ("heartbeat_s", NUM),
        ("max_frame_bytes", INT),  # the largest frame it accepts: clients split bursts under it
    ),
    Headers.ENGINE_REGISTER: (
        ("rank", INT),
        ("capacity", INT),
        ("weight_version", INT),
        ("auth_token", OPT_STR),
        ("block_size", INT),
        ("model", DICT),  # rollout.serving.model_identity: a misfit is refused
        # True when the version is a label on weights that did not come through the weight path
        # (a checkpoint): once a trainer pushes weights, such an engine is held until it has them
        ("version_is_label", BOOL),
    ),
    Headers.ENGINE_REGISTER_ACK: (
        ("engine_id", INT),
        ("heartbeat_s", NUM),
        ("state", STR),
        ("weight_version", INT),  # the coordinator's label: label-only engines adopt it
        ("max_frame_bytes", INT),  # the largest frame it accepts: engines split replies under it
    ),
    Headers.SUBMIT_REQUEST: _SUBMIT_FIELDS,
    Headers.DISPATCH_REQUEST: _DISPATCH_FIELDS,
    Headers.DISPATCH_BATCH: (("requests", Rows(*_DISPATCH_FIELDS)),),
    Headers.SUBMIT_BATCH: (("requests", Rows(*_SUBMIT_FIELDS)),),
    Headers.REPLY: (("replies", Rows(("id", INT), ("record", BYTES))),),
    Headers.REPLY_PARTIAL: (
        (
            "partials",
            Rows(
                ("id", INT),
                ("new_tokens", BYTES),
                ("new_log_probs", BYTES),
                ("new_weight_versions", BYTES),
                ("extra", OPT_BYTES),
                ("new_routed_experts", OPT_BYTES),
            ),
        ),
    ),
    Headers.ABORT_REQUEST: (("id", INT),),
    Headers.PAUSE: _CONTROL,
    Headers.UNPAUSE: _CONTROL,
    Headers.SUSPEND: (("control_id", INT), ("mode", STR), ("weights", STR)),
    Headers.RESUME: _CONTROL,
    Headers.STOP: _CONTROL,
    Headers.SET_WEIGHT_VERSION: (("control_id", INT), ("version", INT), ("rendezvous", OPT_DICT)),
    Headers.CONTROL_ACK: (("control_id", INT), ("signal", INT), ("info", DICT)),
    Headers.ERROR: (("ref_header", OPT_INT), ("ref_id", OPT_INT), ("message", STR)),
    Headers.HEARTBEAT: (("load", DICT),),
    Headers.KV_EVENTS: (("evicted_hashes", BYTES), ("reset", BOOL)),
    Headers.STATS: (("stats_id", INT),),
    Headers.STATS_REPLY: (("stats_id", INT), ("stats", DICT)),
    Headers.DISCONNECT: (),
    Headers.SHUTDOWN: (),
}
assert set(SCHEMA) == set(Headers), "every header needs a schema row"

_HEADER_BY_VALUE = {int(h): h for h in Headers}


def _type_names(types: Any) -> str:
    if isinstance(types, Rows):
        return repr(types)
    return " | ".join("None" if t is type(None) else t.__name__ for t in types)


def _check_fields(header: Headers, fields: list | tuple) -> None:
    schema = SCHEMA[header]
    if len(fields) != len(schema):
        raise ProtocolError(
            f"{header.name}: expected {len(schema)} fields "
            f"({', '.join(n for n, _ in schema) or 'none'}), got {len(fields)}"
        )
    for (name, types), value in zip(schema, fields, strict=True):
        if isinstance(types, Rows):
            _check_rows(header, name, types, value)
        elif type(value) not in types:
            raise ProtocolError(
                f"{header.name}: field {name!r} must be {_type_names(types)}, "
                f"got {type(value).__name__}"
            )


def _check_rows(header: Headers, name: str, rows: Rows, value: Any) -> None:
    if type(value) is not list:
        raise ProtocolError(
            f"{header.name}: field {name!r} must be a list, got {type(value).__name__}"
        )
    n = len(rows.fields)
    for i, row in enumerate(value):
        if type(row) is not list or len(row) != n:
            raise ProtocolError(f"{header.name}: {name}[{i}] must be a list of {n} ({rows!r})")
        for (fname, types), v in zip(rows.fields, row, strict=True):
            if type(v) not in types:
                raise ProtocolError(
                    f"{header.name}: {name}[{i}].{fname} must be {_type_names(types)}, "
                    f"got {type(v).__name__}"
                )


def encode(header: Headers | int, *fields: Any) -> bytes:
    """One frame `[header, *fields]`; the fields are checked against the schema (ProtocolError)."""
    h = _HEADER_BY_VALUE.get(header) if type(header) in (int, Headers) else None
    if h is None:
        raise ProtocolError(f"unknown header {header!r}")
    _check_fields(h, fields)
    return msgpack.packb([int(h), *fields], use_bin_type=True)


MAX_BATCH_ROWS = 256  # rows per SUBMIT_BATCH / DISPATCH_BATCH frame (a 512-token row is ~2 KiB)


def encode_trusted(header: Headers, *fields: Any) -> bytes:
    """`encode` without the schema check, for frames built from values already validated (the
    client's own submissions, rows the coordinator checked on arrival): on the request path the
    check costs more than the packing."""
    return msgpack.packb([int(header), *fields], use_bin_type=True)


def batch_frames(header: Headers, rows: list[list]) -> list[bytes]:
    """Trusted rows as frames of `header` (SUBMIT_BATCH, DISPATCH_BATCH), MAX_BATCH_ROWS each."""
    return [
        encode_trusted(header, rows[i : i + MAX_BATCH_ROWS])
        for i in range(0, len(rows), MAX_BATCH_ROWS)
    ]


def _unpack_bounded(frame: bytes, budget: int = MAX_FRAME_ELEMENTS) -> Any:
    """msgpack.unpackb that gives up once the frame has produced `budget` elements: no single
    container may exceed it (checked before it is built) and hooks count the rest. Every element
    takes at least one byte, so a frame of at most `budget` bytes skips the (costly) hooks."""
    if len(frame) <= budget:
        return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=False,
                               max_array_len=budget, max_map_len=budget, max_ext_len=0)  # fmt: skip
    left = budget

    def spend(container: Any) -> Any:
        nonlocal left
        left -= len(container) + 1
        if left < 0:
            raise ProtocolError(f"frame decodes to more than {budget} elements")
        return container

    return msgpack.unpackb(
        frame,
        raw=False,
        use_list=True,
        strict_map_key=False,
        max_array_len=budget,
        max_map_len=budget,
        max_ext_len=0,  # no ext types on this wire
        list_hook=spend,
        object_hook=spend,
    )


def decode(frame: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> tuple[Headers, list]:
    """(header, fields) of one frame; ProtocolError names whatever is wrong with it."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_frame_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {max_frame_bytes}-byte limit")
    if len(frame) == 0:
        raise ProtocolError("empty frame")
    try:
        msg = _unpack_bounded(frame)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several types (ExtraData, ValueError, TypeError...)
        raise ProtocolError(f"invalid msgpack: {type(e).__name__}: {e}") from None
    if type(msg) is not list or not msg:
        raise ProtocolError(f"frame must be a non-empty msgpack array, got {type(msg).__name__}")
    raw = msg[0]
    h = _HEADER_BY_VALUE.get(raw) if type(raw) is int else None
    if h is None:
        raise ProtocolError(f"unknown header {raw!r}")
    fields = msg[1:]
    _check_fields(h, fields)
    return h, fields


# ---- packed numeric payloads ----------------------------------------------------------------

_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F64 = np.dtype("<f8")


def _as_array(seq: Any, what: str) -> np.ndarray:
    if hasattr(seq, "detach"):  # a torch tensor (duck-typed: the coordinator never imports torch)
        if seq.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {tuple(seq.shape)}")
        return seq.detach().cpu().numpy()
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {seq.shape}")
        return seq
    if isinstance(seq, (list, tuple)):
        return np.asarray(seq) if len(seq) else np.empty(0, dtype=np.int64)
    raise ValueError(f"{what} must be a list, 1-D tensor or ndarray, got {type(seq).__name__}")


def _pack_ints(seq: Any, dtype: np.dtype, what: str) -> bytes:
    arr = _as_array(seq, what)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    info = np.iinfo(dtype)
    if arr.size and (arr.min() < info.min or arr.max() > info.max):
        raise ValueError(f"{what} must fit in {dtype.name}")
    return arr.astype(dtype, copy=False).tobytes()


def _unpack(data: Any, dtype: np.dtype, what: str) -> np.ndarray:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) % dtype.itemsize:
        raise ProtocolError(
            f"{what}: length {len(data)} is not a multiple of {dtype.itemsize} bytes"
        )
    return np.frombuffer(data, dtype=dtype)


_LITTLE = sys.byteorder == "little"


def _pack_int_list(values: Any, code: str, dtype: Any, what: str) -> bytes:
    """Little-endian ints of struct `code`. struct packs a list of ints ~4x faster than numpy;
    it also rejects non-integers and out-of-range values, which then go the numpy way for a
    precise error message."""
    if type(values) in (list, tuple) and _LITTLE and not (values and type(values[0]) is bool):
        try:
            return struct.pack(f"<{len(values)}{code}", *values)
        except (struct.error, TypeError, OverflowError):
            pass
    return _pack_ints(values, dtype, what)


def pack_tokens(tokens: Any) -> bytes:
    """Token ids (list, 1-D tensor, ndarray) as int32 little-endian bytes."""
    return _pack_int_list(tokens, "i", _I32, "tokens")


def unpack_tokens(data: bytes) -> list[int]:
    return _unpack(data, _I32, "tokens").tolist()


def unpack_tokens_array(data: bytes) -> np.ndarray:
    """Zero-copy int32 view (read-only) for callers that build tensors."""
    return _unpack(data, _I32, "tokens")


def pack_hashes(hashes: Any) -> bytes:
    """Block hashes (positive int63) as int64 little-endian bytes."""
    return _pack_ints(hashes, _I64, "hashes")


def unpack_hashes(data: bytes) -> list[int]:
    return _unpack(data, _I64, "hashes").tolist()


def pack_versions(versions: Any) -> bytes:
    """Per-token weight versions as int64 little-endian bytes."""
    return _pack_int_list(versions, "q", _I64, "weight versions")


def pack_experts(rows: Any) -> bytes:
    """Routing replay's experts rows ([tokens, moe_layers, k] uint8/int16 tensor) as their raw
    little-endian bytes: the receiving engine knows the row shape and dtype from its model."""
    return rows.contiguous().numpy().tobytes()


def unpack_versions(data: bytes) -> list[int]:
    return _unpack(data, _I64, "weight versions").tolist()


def pack_floats(values: Any) -> bytes:
    """Log-probs as float64 little-endian bytes (exact for float32 and float64 values)."""
    arr = _as_array(values, "floats")
    if arr.size and arr.dtype.kind not in "fiu":
        raise ValueError(f"floats must be numbers, got dtype {arr.dtype}")
    return arr.astype(_F64, copy=False).tobytes()


def unpack_floats(data: bytes) -> list[float]:
    return _unpack(data, _F64, "floats").tolist()


def pack_obj(obj: Any) -> bytes:
    """An opaque msgpack payload (a record's or sampling params' serialize() dict)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack_obj(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolError(f"invalid msgpack payload: {type(e).__name__}: {e}") from None
