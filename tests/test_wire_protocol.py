from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.protocol import (
    SCHEMA,
    Headers,
    ProtocolError,
    Rows,
    decode,
    encode,
    pack_floats,
    pack_hashes,
    pack_tokens,
    pack_versions,
    unpack_floats,
    unpack_hashes,
    unpack_tokens,
    unpack_versions,
)

# One valid example value per schema type, so every header gets a round trip.
_EXAMPLE = {
    (int,): 7,
    (str,): "x",
    (bytes,): b"\x01\x02",
    (bool,): True,
    (dict,): {"a": 1, 2: [1.5, None]},
    (int, float): 0.25,
    (int, type(None)): None,
    (str, type(None)): "tok",
    (bytes, type(None)): None,
    (dict, type(None)): {"host": "10.0.0.1", "port": 29500, "timeout_s": 60.0},
    (str, bytes): pack_tokens([1, 2, 3]),
}


def _example(types):
    if isinstance(types, Rows):
        return [[_example(t) for _, t in types.fields], [_example(t) for _, t in types.fields]]
    return _EXAMPLE[types]


@pytest.mark.parametrize("header", list(Headers), ids=lambda h: h.name)
def test_round_trip_every_header(header):
    fields = [_example(t) for _, t in SCHEMA[header]]
    h, got = decode(encode(header, *fields))
    assert h is header and got == fields


def test_opaque_bytes_payload_survives_unchanged():
    blob = msgpack.packb({"prompt_tokens": list(range(5))}, use_bin_type=True)
    h, f = decode(encode(Headers.REPLY, [[3, blob], [4, b""]]))
    assert h is Headers.REPLY and f == [[[3, blob], [4, b""]]]


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"", "empty frame"),
        (b"\xc1", "invalid msgpack"),
        (msgpack.packb({"a": 1}), "non-empty msgpack array"),
        (msgpack.packb([]), "non-empty msgpack array"),
        (msgpack.packb([999]), "unknown header 999"),
        (msgpack.packb(["PAUSE", 1]), "unknown header 'PAUSE'"),
        (msgpack.packb([True]), "unknown header True"),
        (msgpack.packb([40]) + b"\x00", "invalid msgpack"),
    ],
)
def test_malformed_frames(frame, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


@pytest.mark.parametrize(
    "fields, match",
    [
        ([int(Headers.SUSPEND), 1], r"SUSPEND: expected 3 fields \(control_id, mode, weights\)"),
        ([int(Headers.DISCONNECT), 1], "DISCONNECT: expected 0 fields"),
    ],
    ids=["suspend-missing-mode", "disconnect-extra-field"],
)
def test_wrong_arity_names_header_and_fields(fields, match):
    with pytest.raises(ProtocolError, match=match):
        decode(msgpack.packb(fields))


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            [20, 1, [1, 2], b"", 4, False, None, None],
            r"SUBMIT_REQUEST: field 'prompt' must be str \| bytes",
        ),
        # bool is not an int on the wire
        ([int(Headers.PAUSE), True], "PAUSE: field 'control_id' must be int, got bool"),
        ([int(Headers.REPLY), [[1, b"a"], [2, "s"]]], r"REPLY: replies\[1\].record must be bytes"),
        ([int(Headers.REPLY), [[1]]], r"REPLY: replies\[0\] must be a list of 2"),
    ],
    ids=["prompt-list", "control-id-bool", "reply-record-str", "reply-row-short"],
)
def test_wrong_type_names_header_and_field(fields, match):
    with pytest.raises(ProtocolError, match=match):
        decode(msgpack.packb(fields, use_bin_type=True))


@pytest.mark.parametrize(
    "args, match",
    [
        (
            (Headers.SET_WEIGHT_VERSION, 1, "v2", None),
            "SET_WEIGHT_VERSION: field 'version' must be int",
        ),
        ((12345,), "unknown header"),
    ],
    ids=["version-str", "unknown-header"],
)
def test_encode_validates_too(args, match):
    with pytest.raises(ProtocolError, match=match):
        encode(*args)


def test_oversize_rejected_and_limit_configurable():
    frame = encode(Headers.REPLY, [[1, b"x" * 5000]])
    with pytest.raises(ProtocolError, match="exceeds the 1000-byte limit"):
        decode(frame, max_frame_bytes=1000)
    assert decode(frame, max_frame_bytes=len(frame))[0] is Headers.REPLY


def _array_header(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


@pytest.mark.parametrize(
    "frame",
    [
        b"\x92\x3d" + _array_header(4_000_000) + b"\xc0" * 4_000_000,  # one array of 4M nils
        b"\x92\x3d" + _array_header(2_000_000) + b"\x80" * 2_000_000,  # 2M empty maps
        # many arrays, each under the per-container cap: only the running budget stops these
        b"\x92\x3d" + _array_header(70) + (_array_header(60_000) + b"\xc0" * 60_000) * 70,
        b"\x92\x3d" + _array_header(70) + (_array_header(60_000) + b"\x80" * 60_000) * 70,
    ],
    ids=["nils", "empty-maps", "nested-nils", "nested-maps"],
)
def test_decoding_work_per_frame_is_bounded(frame):
    """A few MB that would decode to millions of objects are refused after at most
    MAX_FRAME_ELEMENTS of them: memory stays small whatever the frame holds."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=r"max_array_len|more than 262144 elements"):
            decode(frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"decoding peaked at {peak >> 20} MiB"


def test_legitimate_batches_fit_the_decoding_budget():
    rows = [
        [i, b"\0" * 4096, b"\x80", 8, False, None, None] for i in range(256)
    ]  # > 1 MB: hooks engaged
    header, fields = decode(encode(Headers.SUBMIT_BATCH, rows))
    assert header is Headers.SUBMIT_BATCH and len(fields[0]) == 256


def test_pack_tokens_accepts_list_tensor_ndarray():
    ref = [0, 1, 2**31 - 1, 5]
    for src in (ref, torch.tensor(ref), np.array(ref, dtype=np.int64), tuple(ref)):
        data = pack_tokens(src)
        assert len(data) == 16 and unpack_tokens(data) == ref
    assert unpack_tokens(pack_tokens([])) == []


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: pack_tokens([2**31]), ValueError, "fit in int32"),
        (lambda: pack_tokens([1.5]), ValueError, "integers"),
        (lambda: pack_tokens(torch.zeros(2, 2, dtype=torch.long)), ValueError, "1-D"),
        (lambda: unpack_tokens(b"\x00" * 7), ProtocolError, "not a multiple of 4"),
    ],
    ids=["over-int32", "float", "2-D", "unpack-7-bytes"],
)
def test_pack_tokens_rejects_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_pack_hashes_and_floats():
    hs = [1, 2**63 - 1, 12345]
    assert unpack_hashes(pack_hashes(hs)) == hs
    lp = [-0.5, -1e-9, float(np.float32(-3.3))]
    assert unpack_floats(pack_floats(lp)) == lp
    assert unpack_floats(pack_floats(torch.tensor(lp, dtype=torch.float32))) == [
        float(x) for x in np.asarray(lp, dtype=np.float32)
    ]


def test_pack_versions_round_trips_int64():
    vs = [0, 3, 2**62, -1, 10]
    for src in (vs, tuple(vs), np.array(vs, dtype=np.int64), torch.tensor(vs)):
        data = pack_versions(src)
        assert len(data) == 8 * len(vs) and unpack_versions(data) == vs
    assert unpack_versions(pack_versions([])) == []
    with pytest.raises(ValueError, match="fit in int64"):
        pack_versions([2**63])
    with pytest.raises(ValueError, match="integers"):
        pack_versions([1.0])
    with pytest.raises(ProtocolError, match="not a multiple of 8"):
        unpack_versions(b"\x00" * 12)


def test_checkpoint_fields_are_checked():
    """Re-dispatch rows carry the streamed checkpoint (tokens, log-probs, weight versions) and
    partial rows the versions of their tokens, all as packed bytes: a list of ints is refused."""
    row = [1, b"", b"\x80", b"", pack_tokens([5, 6]), pack_floats([-1.0, -2.0]),
           pack_versions([0, 1]), False, b""]  # fmt: skip
    assert decode(encode(Headers.DISPATCH_REQUEST, *row))[1] == row
    with pytest.raises(ProtocolError, match="field 'resume_weight_versions' must be bytes"):
        encode(Headers.DISPATCH_REQUEST, *row[:6], [0, 1], False, b"")
    with pytest.raises(ProtocolError, match=r"requests\[0\]\.resume_weight_versions must be bytes"):
        encode(Headers.DISPATCH_BATCH, [[*row[:6], [0, 1], False, b""]])
    with pytest.raises(ProtocolError, match="DISPATCH_REQUEST: expected 9 fields"):
        encode(Headers.DISPATCH_REQUEST, *row[:6], False, b"")  # a checkpoint without versions
    with pytest.raises(ProtocolError, match="field 'resume_routed_experts' must be bytes"):
        encode(Headers.DISPATCH_REQUEST, *row[:-1], [[0, 1]])  # routed experts packed only
    partial = [3, pack_tokens([5]), b"", pack_versions([2]), None, b"\x01\x02"]
    assert decode(encode(Headers.REPLY_PARTIAL, [partial]))[1] == [[partial]]
    with pytest.raises(ProtocolError, match=r"partials\[0\]\.new_weight_versions must be bytes"):
        encode(Headers.REPLY_PARTIAL, [[3, pack_tokens([5]), b"", [2], None, None]])
    with pytest.raises(ProtocolError, match=r"partials\[0\] must be a list of 6"):
        encode(Headers.REPLY_PARTIAL, [[3, pack_tokens([5]), b"", None]])


def test_register_ack_carries_version_label_and_frame_limit():
    ack = [4, 0.5, "RUNNING", 7, 1 << 20]
    assert decode(encode(Headers.ENGINE_REGISTER_ACK, *ack))[1] == ack
    with pytest.raises(ProtocolError, match="field 'weight_version' must be int, got NoneType"):
        encode(Headers.ENGINE_REGISTER_ACK, 4, 0.5, "RUNNING", None, 1 << 20)
    with pytest.raises(ProtocolError, match=r"expected 5 fields .*max_frame_bytes"):
        decode(msgpack.packb([int(Headers.ENGINE_REGISTER_ACK), 4, 0.5, "RUNNING"]))


# ---- fuzz: nothing but ProtocolError, ever --------------------------------------------------

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_msg = st.recursive(
    _leaf,
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(
            st.text(max_size=4) | st.integers(-(2**63), 2**64 - 1), children, max_size=4
        )
    ),
    max_leaves=20,
)
_header = st.sampled_from([int(h) for h in Headers]) | st.integers(-5, 200)


def _decode_or_protocol_error(frame: bytes) -> None:
    try:
        h, fields = decode(frame)
    except ProtocolError:
        return
    assert isinstance(h, Headers) and isinstance(fields, list)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_fuzz_random_bytes(frame):
    _decode_or_protocol_error(frame)


@settings(max_examples=300, deadline=None)
@given(_msg)
def test_fuzz_random_structures(obj):
    _decode_or_protocol_error(msgpack.packb(obj, use_bin_type=True))


@settings(max_examples=300, deadline=None)
@given(_header, st.lists(_msg, max_size=8))
def test_fuzz_header_plus_random_fields(header, fields):
    _decode_or_protocol_error(msgpack.packb([header, *fields], use_bin_type=True))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(list(Headers)), st.data())
def test_fuzz_mutated_valid_frames(header, data):
    frame = bytearray(encode(header, *[_example(t) for _, t in SCHEMA[header]]))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(bytes(frame))
