from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout.sampling import SamplingParams


def test_defaults_match_contract():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.num_tokens_to_generate) == (1.0, 0, 1.0, 16)
    assert sp.stop_words == [] and sp.stop_token_ids == []
    assert sp.return_log_probs is False and sp.return_prompt_log_probs is False
    assert sp.top_n_logprobs == 0 and sp.seed is None and sp.ignore_eos is False
    assert not sp.is_greedy
    # mutable defaults are not shared between instances
    a, b = SamplingParams(), SamplingParams()
    a.stop_words.append("x")
    assert b.stop_words == []


INVALID = [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1.0"),
    ("temperature", True),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_k", 2**63),  # overflowed inside the engine step
    ("top_k", 2**31),
    ("top_p", 0.0),
    ("top_p", 1.0001),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("num_tokens_to_generate", 0),
    ("num_tokens_to_generate", 2.0),
    ("num_tokens_to_generate", 2**64),  # was an OverflowError (msgpack) past validation
    ("num_tokens_to_generate", 2**31),
    ("stop_words", "stop"),
    ("stop_words", [""]),
    ("stop_words", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 5),
    ("stop_token_ids", [2**31]),
    ("top_n_logprobs", -1),
    ("top_n_logprobs", 1025),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.0),
    ("return_log_probs", 1),
    ("return_prompt_log_probs", None),
    ("ignore_eos", "yes"),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("logit_bias", {1: 101.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"a": 1.0}),
    ("logit_bias", [1]),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-3]),
    ("bad_words", "x"),
    ("bad_words", [" "]),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("min_p", 1.5),
    ("min_p", math.nan),
]


@pytest.mark.parametrize("field, value", INVALID)
def test_invalid_values_name_field_and_value(field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    msg = str(exc.value)
    assert field in msg
    assert repr(value) in msg or str(value) in msg


def test_valid_edge_values_and_normalisation():
    sp = SamplingParams(
        temperature=0,
        top_k=np.int64(3),
        top_p=1,
        stop_words=("a", "bc"),
        stop_token_ids=(np.int32(0), 7),
        seed=2**63 - 1,
    )
    assert type(sp.temperature) is float and sp.temperature == 0.0
    assert type(sp.top_k) is int and sp.top_k == 3
    assert type(sp.top_p) is float
    assert sp.stop_words == ["a", "bc"]
    assert sp.stop_token_ids == [0, 7] and all(type(t) is int for t in sp.stop_token_ids)
    assert sp.seed == 2**63 - 1


@pytest.mark.parametrize(
    "kw, greedy",
    [
        ({}, False),
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"top_k": 2}, False),
        ({"temperature": 1e-46}, True),  # below GREEDY_BELOW: the limit, without overflow
        ({"top_p": 1e-46}, True),
        ({"temperature": 1e-5}, False),
        ({"top_p": 1e-5}, False),
    ],
)
def test_is_greedy(kw, greedy):
    assert SamplingParams(**kw).is_greedy is greedy


def test_replace_validates_and_copies():
    sp = SamplingParams(stop_words=["x"])
    sp2 = sp.replace(num_tokens_to_generate=3)
    assert sp2.num_tokens_to_generate == 3 and sp.num_tokens_to_generate == 16
    assert sp2.stop_words == ["x"]
    with pytest.raises(ValueError, match="num_tokens_to_generate"):
        sp.replace(num_tokens_to_generate=0)
    with pytest.raises(ValueError, match="bogus"):
        sp.replace(bogus=1)


@pytest.mark.parametrize(
    "obj, match",
    [
        ({"temperature": 0.5, "nope": 1}, "nope"),
        ([("temperature", 0.5)], "dict"),
        ({"top_p": 2.0}, "top_p"),
    ],
    ids=["unknown-key", "not-a-dict", "top-p-above-1"],
)
def test_deserialize_rejects_unknown_keys_non_dicts_and_bad_values(obj, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.deserialize(obj)


def test_deserialize_of_a_partial_dict_fills_defaults():
    assert SamplingParams.deserialize({"top_k": 5}) == SamplingParams(top_k=5)


@pytest.mark.parametrize("field, value", INVALID)
def test_deserialize_of_complete_dict_validates(field, value):
    """A complete dict takes the no-__init__ fast path: it must reject exactly what __init__ does."""
    obj = SamplingParams(stop_words=["s"], stop_token_ids=[2], seed=5).serialize()
    obj[field] = value
    with pytest.raises(ValueError, match=field):
        SamplingParams.deserialize(obj)


def test_deserialize_normalises_and_does_not_alias_input():
    obj = SamplingParams().serialize()
    obj.update(temperature=1, top_k=np.int64(2), stop_token_ids=(np.int32(3),), seed=np.uint8(4))
    sp = SamplingParams.deserialize(obj)
    assert (type(sp.temperature), type(sp.top_k), type(sp.seed)) == (float, int, int)
    assert sp.stop_token_ids == [3] and type(sp.stop_token_ids[0]) is int
    obj = SamplingParams(stop_words=["a"], stop_token_ids=[1]).serialize()
    sp = SamplingParams.deserialize(obj)
    obj["stop_words"].append("b")
    obj["stop_token_ids"].append(2)
    assert sp.stop_words == ["a"] and sp.stop_token_ids == [1]


sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0, 10, allow_nan=False),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0, 1, exclude_min=True),
    num_tokens_to_generate=st.integers(1, 10_000),
    stop_words=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=3),
    return_log_probs=st.booleans(),
    top_n_logprobs=st.integers(0, 20),
    return_prompt_log_probs=st.booleans(),
    seed=st.none() | st.integers(0, 2**63 - 1),
    ignore_eos=st.booleans(),
    min_tokens=st.integers(0, 100),
    logit_bias=st.none() | st.dictionaries(st.integers(0, 2**31 - 1), st.floats(-100, 100)),
    allowed_token_ids=st.none() | st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=3),
    bad_words=st.lists(st.text(min_size=1, max_size=5).filter(str.strip), max_size=3),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0, 10, exclude_min=True),
    min_p=st.floats(0, 1),
)


@given(sampling_params)
def test_msgpack_round_trip_is_exact(sp):
    wire = msgpack.packb(sp.serialize(), use_bin_type=True)  # the protocol's unpacking options:
    back = SamplingParams.deserialize(msgpack.unpackb(wire, raw=False, strict_map_key=False))
    assert back == sp
    assert back.serialize() == sp.serialize()
    assert all(type(getattr(back, f)) is type(getattr(sp, f)) for f in sp.serialize())


def test_serialize_returns_fresh_lists():
    sp = SamplingParams(stop_token_ids=[3])
    sp.serialize()["stop_token_ids"].append(4)
    assert sp.stop_token_ids == [3]


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": 10**400}, "temperature"),  # float() overflows: still a ValueError
        ({"top_k": 10**5000}, "top_k"),  # too long to print: still named
        ({"stop_words": ["x"] * 65}, "stop_words"),
        ({"stop_words": ["x" * 513]}, "stop_words"),
        ({"stop_token_ids": [1] * 4097}, "stop_token_ids"),
    ],
)
def test_limits_raise_value_error_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
    obj = SamplingParams().serialize() | kw  # the deserialize fast path rejects them too
    with pytest.raises(ValueError, match=field):
        SamplingParams.deserialize(obj)


def test_vllm_spellings_of_off():
    """vLLM's no-op values: top_k -1 is off (stored as 0), the rest are the defaults."""
    sp = SamplingParams(top_k=-1, min_p=0, repetition_penalty=1, presence_penalty=0)
    assert sp == SamplingParams() and type(sp.min_p) is float and not sp.processes_logits
    assert SamplingParams(logit_bias={"7": -100}).logit_bias == {7: -100.0}


def test_check_catches_fields_changed_after_construction():
    sp = SamplingParams(top_k=5)
    sp.check()
    sp.top_k = 2**63
    with pytest.raises(ValueError, match="top_k"):
        sp.check()
