"""Request records on the wire: tensor codecs, exact msgpack round trips, validation on
deserialize."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from request_helpers import ET, i32, make

from rollout.codecs import deserialize_tensor, serialize_tensor
from rollout.hashing import compute_block_hashes_batched
from rollout.request import (
    DynamicInferenceEvent,
    DynamicInferenceRequest,
    DynamicInferenceRequestRecord,
    Status,
)
from rollout.sampling import SamplingParams

# ---------------------------------------------------------------- serialization


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(5, dtype=torch.int32),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.randn(3, 2).to(torch.bfloat16),
        torch.tensor([True, False]),
        torch.tensor(7),
        torch.empty(0, dtype=torch.int32),
        torch.from_numpy(np.zeros(0, dtype=np.int64)),  # odd strides
        torch.zeros(2, 0, 3),
        torch.arange(10)[::3],
    ],
)
def test_tensor_codec_exact(t):
    obj = msgpack.unpackb(msgpack.packb(serialize_tensor(t)))
    back = deserialize_tensor(obj)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_tensor_codec_rejects_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        deserialize_tensor({"dtype": "nonsense", "shape": [1], "data": b"\0" * 8})
    with pytest.raises(ValueError, match="bytes"):
        deserialize_tensor({"dtype": "int32", "shape": [3], "data": b"\0" * 8})


def _events_st():
    payload = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | no_nan
        | st.text(max_size=4)
        | st.binary(max_size=4),
        lambda kids: (
            st.lists(kids, max_size=3)
            | st.dictionaries(st.text(max_size=3) | st.integers(-5, 5), kids, max_size=3)
        ),
        max_leaves=6,
    )
    ev_type = st.sampled_from(
        [t for t in ET if t not in (ET.ERROR_TRANSIENT, ET.ERROR_NONTRANSIENT)]
    )
    plain = st.builds(DynamicInferenceEvent, ev_type, st.floats(0, 2e9), payload)
    err = st.builds(
        lambda tr, msg, ts: DynamicInferenceEvent(
            ET.ERROR_TRANSIENT if tr else ET.ERROR_NONTRANSIENT,
            ts,
            {"type": "E", "message": msg, "is_transient": tr},
        ),
        st.booleans(),
        st.text(max_size=5),
        st.floats(0, 2e9),
    )
    return st.lists(plain | err, max_size=4)


no_nan = st.floats(allow_nan=False)
stale = st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=6).map(i32)


@st.composite
def requests_st(draw):
    n_gen = draw(st.integers(0, 6))
    toks = st.lists(st.integers(0, 2**62), min_size=n_gen, max_size=n_gen)
    topn = st.dictionaries(st.integers(0, 2**31), no_nan, max_size=3)
    return DynamicInferenceRequest(
        request_id=draw(st.integers(0, 2**63 - 1)),
        prompt=draw(st.none() | st.text(max_size=8)),
        sampling_params=SamplingParams(
            temperature=draw(st.floats(0, 2)),
            top_k=draw(st.integers(0, 9)),
            num_tokens_to_generate=draw(st.integers(1, 99)),
            stop_words=draw(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
            seed=draw(st.none() | st.integers(0, 2**63 - 1)),
        ),
        prompt_tokens=draw(st.none() | st.lists(st.integers(0, 2**62), max_size=8)),
        arrival_time=draw(no_nan),
        status=draw(st.sampled_from(Status)),
        generated_text=draw(st.none() | st.text(max_size=8)),
        generated_tokens=draw(toks),
        generated_log_probs=draw(st.lists(no_nan, max_size=n_gen)),
        generated_top_n_logprobs=draw(st.lists(topn, max_size=n_gen)),
        prompt_log_probs=draw(st.none() | st.lists(no_nan, max_size=5)),
        prompt_top_n_logprobs=draw(st.none() | st.lists(topn, max_size=2)),
        tpot=draw(st.lists(no_nan, max_size=5)),
        generated_weight_versions=draw(st.lists(st.integers(0, 2**62), max_size=n_gen)),
        stop_reason=draw(st.sampled_from([None, "length", "eos", "stop_word", "abort"])),
        policy_staleness=draw(stale),
        kv_cache_staleness=draw(stale),
        block_size_tokens=draw(st.none() | st.integers(1, 64)),
        precomputed_block_hashes=draw(st.lists(st.integers(1, 2**63 - 1), max_size=3)),
        events=draw(_events_st()),
        ttft=draw(st.none() | no_nan),
        latency=draw(st.none() | no_nan),
        last_token_time=draw(st.none() | no_nan),
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(requests_st(), max_size=3), st.none() | no_nan)
def test_record_round_trip_is_exact(reqs, latency):
    rec = DynamicInferenceRequestRecord(requests=reqs, latency=latency)
    obj = rec.serialize()
    wire = msgpack.packb(obj, use_bin_type=True)  # no default=: everything is msgpack-native
    assert (
        DynamicInferenceRequestRecord.deserialize(
            msgpack.unpackb(wire, raw=False, strict_map_key=False)
        )
        == rec
    )
    back = DynamicInferenceRequestRecord.from_bytes(rec.to_bytes())
    assert back == rec
    assert back.serialize() == obj
    for a, b in zip(back.requests, reqs, strict=True):
        for f in dataclasses.fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            assert type(va) is type(vb), f.name


def test_special_floats_are_bit_exact():
    vals = [-0.0, float("nan"), float("inf"), -float("inf"), 5e-324, 0.1, -1.0000000000000002]
    r = make(generated_log_probs=list(vals), prompt_log_probs=list(vals), tpot=list(vals))
    back = DynamicInferenceRequest.deserialize(
        msgpack.unpackb(msgpack.packb(r.serialize()), strict_map_key=False)
    )
    for name in ("generated_log_probs", "prompt_log_probs", "tpot"):
        assert np.array(getattr(back, name)).tobytes() == np.array(vals).tobytes()


def test_serialize_packs_tokens_and_tensors():
    r = make(
        tokens=[1, 2],
        generated_tokens=[3],
        generated_log_probs=[-0.5],
        policy_staleness=i32([1, 1, 1]),
    )
    obj = r.serialize()
    assert isinstance(obj["generated_tokens"], bytes) and len(obj["generated_tokens"]) == 8
    assert isinstance(obj["generated_log_probs"], bytes)
    assert obj["prompt_tokens"]["dtype"] == "int64" and obj["prompt_tokens"]["shape"] == [2]
    assert obj["policy_staleness"]["dtype"] == "int32"
    assert obj["status"] == "WAITING_IN_QUEUE" and obj["kv_cache_staleness"] is None
    assert obj["sampling_params"]["num_tokens_to_generate"] == 8


def test_deserialize_accepts_plain_lists():
    obj = make().serialize()
    obj.update(
        generated_tokens=[1, 2],
        generated_log_probs=[-1.0, -2.0],
        generated_top_n_logprobs=[{1: -1.0}, {"2": -2.0}],
    )
    r = DynamicInferenceRequest.deserialize(obj)
    assert r.generated_tokens == [1, 2] and r.generated_log_probs == [-1.0, -2.0]
    assert r.generated_top_n_logprobs == [{1: -1.0}, {2: -2.0}]


@pytest.mark.parametrize(
    "change, match",
    [
        ({"bogus": 1}, "bogus"),
        ({"status": "DONE"}, "status"),
        ({"sampling_params": {"top_p": 5.0}}, "top_p"),
        ({"generated_tokens": b"\x01\x02\x03"}, "generated_tokens"),
        ({"prompt_tokens": {"dtype": "int64", "shape": [2]}}, "prompt_tokens"),
        ({"events": [{"type": "BOGUS"}]}, "BOGUS"),
    ],
)
def test_deserialize_rejects_bad_fields(change, match):
    obj = make().serialize()
    obj.update(change)
    with pytest.raises(ValueError, match=match):
        DynamicInferenceRequest.deserialize(obj)


def test_deserialize_of_complete_dict_normalises():
    """A complete dict skips the generated __init__; __post_init__ must still run on it."""
    obj = make(block_size_tokens=2).serialize()
    before = msgpack.packb(obj)
    r = DynamicInferenceRequest.deserialize(obj)
    assert msgpack.packb(obj) == before  # the input is not modified
    assert r == make(block_size_tokens=2)
    r.prompt_tokens[0] = 99  # a fresh, writable tensor: nothing aliases the wire buffer
    assert deserialize_tensor(obj["prompt_tokens"]).tolist() == [1, 2, 3, 4, 5]
    stale = serialize_tensor(torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64))
    r = DynamicInferenceRequest.deserialize(
        obj | {"prompt_tokens": serialize_tensor(i32([4, 5])), "kv_cache_staleness": stale}
    )
    assert r.prompt_tokens.dtype == torch.int64 and r.kv_cache_staleness.dtype == torch.int32


@pytest.mark.parametrize(
    "change, match",
    [
        ({"request_id": True}, "request_id"),
        ({"prompt_tokens": serialize_tensor(torch.tensor([1.0]))}, "prompt_tokens"),
        ({"prompt_tokens": serialize_tensor(torch.zeros(2, 2, dtype=torch.int64))}, "1-D"),
        ({"policy_staleness": serialize_tensor(torch.zeros(2, 2, dtype=torch.int32))}, "policy"),
        ({"block_size_tokens": 0}, "block_size_tokens"),
        ({"tpot": b"\0" * 7}, "tpot"),
        ({"events": 0}, "events"),
        ({"events": [{"type": "FINISH", "timestamp": 1.0, "payload": [2**64]}]}, "payload"),
    ],
    ids=[
        "request-id-bool",
        "prompt-float",
        "prompt-2-D",
        "policy-staleness-2-D",
        "block-size-0",
        "tpot-7-bytes",
        "events-int",
        "event-payload-over-uint64",
    ],
)
def test_deserialize_of_complete_dict_rejects_what_the_constructor_does(change, match):
    """The complete-dict path skips the generated __init__: validation must still run."""
    obj = make(block_size_tokens=2).serialize()
    with pytest.raises(ValueError, match=match):
        DynamicInferenceRequest.deserialize(obj | change)


def test_deserialize_fills_missing_fields_with_defaults():
    r = DynamicInferenceRequest.deserialize({"request_id": 3, "arrival_time": 1.0})
    assert r == DynamicInferenceRequest(3, arrival_time=1.0)
    r = DynamicInferenceRequest.deserialize(
        {"request_id": 3, "prompt_tokens": serialize_tensor(torch.arange(5)),
         "block_size_tokens": 2, "enable_prefix_caching": True}
    )  # fmt: skip
    assert r.precomputed_block_hashes == compute_block_hashes_batched(torch.arange(5), 2)


@pytest.mark.parametrize(
    "data", [b"\xc1", b"", msgpack.packb([1, 2]), msgpack.packb({"requests": [], "x": 1}), "str"]
)
def test_from_bytes_rejects_garbage(data):
    with pytest.raises(ValueError):
        DynamicInferenceRequestRecord.from_bytes(data)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_round_trip_and_stay_on_device():
    r = make(tokens=torch.tensor([1, 2, 3], device="cuda"))
    rec = DynamicInferenceRequestRecord.from_request(r)
    rec.increment_staleness()
    assert r.policy_staleness.device.type == "cuda"
    r.append_token(4)
    new = rec.checkpoint()
    assert new.prompt_tokens.device.type == "cuda"
    back = DynamicInferenceRequestRecord.from_bytes(rec.to_bytes())
    assert back[1].prompt_tokens.tolist() == [1, 2, 3, 4] and back == rec
