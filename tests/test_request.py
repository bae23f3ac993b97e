"""Request records: events, lengths, staleness, checkpoint and merge."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from request_helpers import ET, i32, make

from rollout.hashing import compute_block_hashes_batched
from rollout.request import (
    DynamicInferenceEvent,
    DynamicInferenceRequest,
    DynamicInferenceRequestRecord,
    InferenceRequest,
    Status,
)

# ---------------------------------------------------------------- enums and events


def test_enums():
    assert [(s.name, s.value) for s in Status] == [
        ("WAITING_IN_QUEUE", 1),
        ("ACTIVE_AND_GENERATING_TOKENS", 2),
        ("ACTIVE_BUT_NOT_GENERATING_TOKENS", 3),
        ("COMPLETED", 4),
        ("FAILED", 5),
    ]
    assert [t.name for t in ET] == [
        "ADD_ENGINE",
        "ADD_CONTEXT",
        "GENERATED_TOKEN",
        "PAUSE",
        "EVICT",
        "FINISH",
        "FAIL",
        "ERROR_TRANSIENT",
        "ERROR_NONTRANSIENT",
    ]


def test_event_defaults_and_round_trip():
    t0 = time.time()
    e = DynamicInferenceEvent(ET.PAUSE)
    assert t0 <= e.timestamp <= time.time() and e.payload is None
    e = DynamicInferenceEvent(ET.GENERATED_TOKEN, 1.5, {"token_id": 3, 4: [b"x", None, 2.5]})
    wire = msgpack.unpackb(msgpack.packb(e.serialize()), strict_map_key=False)
    assert wire["type"] == "GENERATED_TOKEN"
    assert DynamicInferenceEvent.deserialize(wire) == e
    assert "GENERATED_TOKEN" in str(e)


@pytest.mark.parametrize(
    "payload", [(1, 2), torch.tensor([1]), {1.5: 2}, {"a": object()}, [2**64], np.int64(3)]
)
def test_event_payload_must_be_msgpack_native(payload):
    with pytest.raises(ValueError, match="payload"):
        DynamicInferenceEvent(ET.FINISH, payload=payload)


@pytest.mark.parametrize(
    "make_event, match",
    [
        (lambda: DynamicInferenceEvent("FINISH"), "event type"),
        (
            lambda: DynamicInferenceEvent(ET.ERROR_TRANSIENT, payload={"message": "x"}),
            "is_transient",
        ),
        (lambda: DynamicInferenceEvent.deserialize({"type": "NOPE", "timestamp": 1.0}), "NOPE"),
    ],
    ids=["type-as-str", "transient-without-flag", "unknown-type"],
)
def test_event_validation(make_event, match):
    with pytest.raises(ValueError, match=match):
        make_event()


def test_event_deserialize_validates_like_the_constructor():
    e = DynamicInferenceEvent.deserialize({"type": "PAUSE", "timestamp": 2})
    assert type(e.timestamp) is float and e.timestamp == 2.0 and e.payload is None
    e = DynamicInferenceEvent.deserialize({"type": "EVICT", "timestamp": 3.5, "payload": [1]})
    assert e == DynamicInferenceEvent(ET.EVICT, 3.5, [1])
    with pytest.raises(ValueError, match="payload"):
        DynamicInferenceEvent.deserialize({"type": "FINISH", "timestamp": 1.0, "payload": (1, 2)})
    for payload in (None, {"message": "x"}):
        with pytest.raises(ValueError, match="is_transient"):
            DynamicInferenceEvent.deserialize(
                {"type": "ERROR_TRANSIENT", "timestamp": 1.0, "payload": payload}
            )


def test_event_helpers_cover_every_type():
    r = make()
    r.add_event_add_engine()
    r.add_event_add_context()
    r.add_event_generated_token(5, blocks_total=10, blocks_ref_count=3)
    r.add_event_pause()
    r.add_event_evict()
    r.add_event_finish()
    r.add_event_fail()
    r.add_event_error_transient(TimeoutError("slow"))
    r.add_event_error_nontransient(ValueError("bad"))
    assert [e.type for e in r.events] == list(ET)
    ts = [e.timestamp for e in r.events]
    assert ts == sorted(ts)
    assert r.events[2].payload == {"token_id": 5, "blocks_total": 10, "blocks_ref_count": 3}
    assert r.events[7].payload == {"type": "TimeoutError", "message": "slow", "is_transient": True}
    assert r.events[8].payload == {"type": "ValueError", "message": "bad", "is_transient": False}


def test_succeeded_and_failed():
    r = make()
    r.add_event_error_transient(RuntimeError("retry"))
    assert r.succeeded() and not r.failed()
    r.add_event_error_nontransient(RuntimeError("fatal"))
    assert r.failed() and not r.succeeded()
    r2 = make()
    r2.add_event_fail()
    assert r2.failed()
    r3 = make(status=Status.FAILED)
    assert r3.failed()


# ---------------------------------------------------------------- request basics


def test_request_normalisation_and_lengths():
    r = make(tokens=np.array([4, 5, 6], dtype=np.int32), n=5)
    assert r.prompt_tokens.dtype == torch.int64 and r.prompt_tokens.tolist() == [4, 5, 6]
    assert r.status is Status.WAITING_IN_QUEUE and r.arrival_time == 100.0
    assert (r.total_length, r.prompt_length, r.remaining_tokens_to_generate) == (3, 3, 5)
    r.append_token(9)
    assert (r.total_length, r.remaining_tokens_to_generate) == (4, 4)
    t0 = time.time()
    assert t0 - 1 <= DynamicInferenceRequest(1).arrival_time <= time.time()
    assert isinstance(r, InferenceRequest)
    r32 = make(tokens=torch.tensor([1, 2], dtype=torch.int32))
    assert r32.prompt_tokens.dtype == torch.int64 and r32.prompt_tokens.tolist() == [1, 2]
    assert make(tokens=[]).prompt_tokens.dtype == torch.int64


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"request_id": "1"}, "request_id"),
        ({"request_id": True}, "request_id"),
        ({"prompt_tokens": [1.5]}, "prompt_tokens"),
        ({"prompt_tokens": [[1, 2]]}, "prompt_tokens"),
        ({"sampling_params": {"top_k": 1}}, "sampling_params"),
        ({"status": 1}, "status"),
        ({"policy_staleness": [1, 2]}, "policy_staleness"),
        ({"kv_cache_staleness": torch.zeros(2, 2, dtype=torch.int32)}, "kv_cache_staleness"),
        ({"block_size_tokens": 0}, "block_size_tokens"),
        ({"block_size_tokens": 2.5}, "block_size_tokens"),
        ({"prompt_tokens": torch.tensor([1.0])}, "prompt_tokens"),
    ],
)
def test_request_validation(kw, match):
    kw.setdefault("request_id", 1)
    with pytest.raises(ValueError, match=match):
        DynamicInferenceRequest(**kw)


def test_append_token_timing_and_versions():
    r = make(arrival_time=10.0)
    r.append_token(1, -0.5, {1: -0.5, 2: -1.0}, weight_version=3, now=10.25)
    r.append_token(2, -0.75, {2: -0.75}, weight_version=4, now=10.5)
    r.append_token(3, -1.0, {3: -1.0}, weight_version=3, now=11.0)
    assert r.ttft == 0.25 and r.tpot == [0.25, 0.5] and r.last_token_time == 11.0
    assert r.generated_tokens == [1, 2, 3] and r.generated_log_probs == [-0.5, -0.75, -1.0]
    assert r.generated_top_n_logprobs[0] == {1: -0.5, 2: -1.0}
    assert r.weight_versions == [3, 4] and r.weight_version_span == (3, 4)
    assert make().weight_versions == [] and make().weight_version_span is None


def test_block_hashes_computed_only_with_prefix_caching():
    toks = list(range(10))
    r = make(tokens=toks, block_size_tokens=4, enable_prefix_caching=True)
    assert r.precomputed_block_hashes == compute_block_hashes_batched(toks, 4)
    assert len(r.precomputed_block_hashes) == 2
    assert make(tokens=toks, block_size_tokens=4).precomputed_block_hashes == []
    given_hashes = make(
        tokens=toks,
        block_size_tokens=4,
        enable_prefix_caching=True,
        precomputed_block_hashes=[5, 6],
    )
    assert given_hashes.precomputed_block_hashes == [5, 6]  # not recomputed


# ---------------------------------------------------------------- staleness


def test_increment_staleness_semantics():
    rec = DynamicInferenceRequestRecord.from_request(make(tokens=[1, 2, 3]))
    r = rec[0]
    rec.increment_staleness()
    assert r.policy_staleness.tolist() == [1, 1, 1] and r.policy_staleness.dtype == torch.int32
    assert r.kv_cache_staleness.tolist() == [1, 1, 1] and r.kv_cache_staleness.dtype == torch.int32
    r.append_token(4)
    r.append_token(5)
    rec.increment_staleness(policy_only=True)
    assert r.policy_staleness.tolist() == [2, 2, 2, 1, 1]
    assert r.kv_cache_staleness.tolist() == [1, 1, 1]  # untouched
    rec.increment_staleness()
    assert r.policy_staleness.tolist() == [3, 3, 3, 2, 2]
    assert r.kv_cache_staleness.tolist() == [2, 2, 2, 1, 1]
    r.reset_kv_staleness(2)
    assert r.kv_cache_staleness.tolist() == [2, 2, 0, 0, 0]
    r.append_token(6)
    r.reset_kv_staleness()
    assert r.kv_cache_staleness.tolist() == [0] * 6
    assert r.policy_staleness.tolist() == [3, 3, 3, 2, 2]  # policy untouched by KV reset
    for bad in (-1, 7):
        with pytest.raises(ValueError, match="start"):
            r.reset_kv_staleness(bad)


def test_staleness_longer_than_request_is_an_error():
    r = make(tokens=[1, 2], policy_staleness=i32([1, 1, 1]))
    with pytest.raises(ValueError, match="staleness"):
        r.increment_staleness()


# A random lifecycle: the engine's view (split record) vs an uninterrupted request vs a list model.
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("tok"), st.integers(0, 50_000), st.floats(-30, 0), st.integers(0, 3)),
        st.tuples(st.just("inc"), st.booleans()),
        st.tuples(st.just("reset"), st.floats(0, 1)),
        st.tuples(st.just("ckpt")),
    ),
    max_size=40,
)


def _run_lifecycle(prompt, ops, slack, prefix_caching):
    n_tok = sum(op[0] == "tok" for op in ops)
    kw = {"block_size_tokens": 3, "enable_prefix_caching": prefix_caching, "prompt": "p"}
    whole = make(tokens=prompt, n=n_tok + slack, **kw)
    rec = DynamicInferenceRequestRecord.from_request(make(tokens=prompt, n=n_tok + slack, **kw))
    model_p, model_kv, t = None, None, 100.0
    for op in ops:
        seg = rec[-1]
        if op[0] == "tok":
            t += 0.5
            top = {op[1]: op[2], op[1] + 1: op[2] - 1.0}
            for r in (whole, seg):
                r.append_token(op[1], op[2], top, weight_version=op[3], now=t)
                r.events.append(DynamicInferenceEvent(ET.GENERATED_TOKEN, t, {"token_id": op[1]}))
        elif op[0] == "inc":
            n = whole.total_length
            model_p = [x + 1 for x in (model_p or []) + [0] * (n - len(model_p or []))]
            if not op[1]:
                model_kv = [x + 1 for x in (model_kv or []) + [0] * (n - len(model_kv or []))]
            whole.increment_staleness(policy_only=op[1])
            rec.increment_staleness(policy_only=op[1])
        elif op[0] == "reset":
            n = whole.total_length
            start = int(op[1] * n)
            model_kv = ((model_kv or []) + [0] * (n - len(model_kv or [])))[:start] + [0] * (
                n - start
            )
            whole.reset_kv_staleness(start)
            seg.reset_kv_staleness(start)
        elif seg.remaining_tokens_to_generate >= 1:
            before = {k: getattr(seg, k) for k in ("policy_staleness", "kv_cache_staleness")}
            before = {k: None if v is None else v.tolist() for k, v in before.items()}
            new = rec.checkpoint()
            assert new is rec[-1] and rec[-2] is seg
            for k, old in before.items():  # carried over prompt+generated, zero-padded, a copy
                assert getattr(seg, k) is None if old is None else getattr(seg, k).tolist() == old
                carried = getattr(new, k)
                if old is None:
                    assert carried is None
                else:
                    assert carried.tolist() == old + [0] * (seg.total_length - len(old))
                    assert carried.numel() == new.prompt_length and carried is not getattr(seg, k)
    for r in (whole, rec[-1]):
        r.status, r.stop_reason, r.generated_text = Status.COMPLETED, "length", None
    return whole, rec, model_p, model_kv


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 50_000), min_size=1, max_size=12),
    ops_st,
    st.integers(1, 3),
    st.booleans(),
)
def test_merge_of_checkpointed_record_equals_uninterrupted(prompt, ops, slack, prefix_caching):
    whole, rec, model_p, model_kv = _run_lifecycle(prompt, ops, slack, prefix_caching)
    merged = rec.merge()
    for name in ("policy_staleness", "kv_cache_staleness"):
        t = getattr(merged, name)
        assert t is None or (t.numel() == merged.total_length and t.dtype == torch.int32)
        w = getattr(whole, name)  # untracked positions of the uninterrupted run count as 0
        if w is not None:
            setattr(whole, name, torch.cat([w, w.new_zeros(whole.total_length - w.numel())]))
    assert merged == whole
    # staleness agrees with the list model and covers prompt + generated where tracked
    for t, m in ((merged.policy_staleness, model_p), (merged.kv_cache_staleness, model_kv)):
        assert (t is None and m is None) or t.tolist() == m + [0] * (t.numel() - len(m))
    # the record survives the wire, and still merges to the same request
    back = DynamicInferenceRequestRecord.from_bytes(rec.to_bytes())
    assert back == rec and back.merge() == whole
    assert len(merged.tpot) == max(0, len(merged.generated_tokens) - 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=12), ops_st, st.booleans())
def test_checkpoint_segments(prompt, ops, prefix_caching):
    _, rec, _, _ = _run_lifecycle(prompt, ops, 1, prefix_caching)
    n_total = rec[0].sampling_params.num_tokens_to_generate
    produced = []
    for i, seg in enumerate(rec.requests):
        assert seg.request_id == rec.request_id == 7
        assert seg.prompt_tokens.tolist() == list(prompt) + produced
        assert seg.sampling_params.num_tokens_to_generate == n_total - len(produced)
        assert seg.arrival_time == rec[0].arrival_time
        if prefix_caching:
            assert seg.precomputed_block_hashes == compute_block_hashes_batched(
                seg.prompt_tokens, 3
            )
        else:
            assert seg.precomputed_block_hashes == []
        assert seg.block_size_tokens == 3 and seg.enable_prefix_caching == prefix_caching
        if i < len(rec) - 1:
            assert seg.status is Status.WAITING_IN_QUEUE
        # events stay with the segment that produced them
        assert [e.payload["token_id"] for e in seg.events] == seg.generated_tokens
        produced += seg.generated_tokens


def test_checkpoint_fresh_state_and_carry():
    rec = DynamicInferenceRequestRecord.from_request(make(tokens=[1, 2, 3], n=4))
    r = rec[0]
    r.status = Status.ACTIVE_AND_GENERATING_TOKENS
    r.add_event_add_engine()
    r.append_token(8, -0.1, {8: -0.1}, weight_version=0, now=101.0)
    rec.increment_staleness()
    r.append_token(9, -0.2, {9: -0.2}, weight_version=0, now=102.0)
    r.prompt_log_probs = [-1.0, -2.0]
    r.sampling_params = r.sampling_params.replace(return_prompt_log_probs=True)
    r.add_event_evict()
    new = rec.checkpoint()
    assert len(rec) == 2 and rec[1] is new
    assert new.prompt_tokens.tolist() == [1, 2, 3, 8, 9]
    assert new.sampling_params.num_tokens_to_generate == 2
    assert new.sampling_params.return_prompt_log_probs is False
    assert new.status is Status.WAITING_IN_QUEUE
    assert new.generated_tokens == new.generated_log_probs == new.tpot == new.events == []
    assert new.generated_weight_versions == [] and new.generated_top_n_logprobs == []
    assert new.ttft is None and new.last_token_time == 102.0
    assert new.policy_staleness.tolist() == [1, 1, 1, 1, 0]
    assert new.kv_cache_staleness.tolist() == [1, 1, 1, 1, 0]
    new.policy_staleness += 5  # independent copies
    assert r.policy_staleness.tolist() == [1, 1, 1, 1]
    assert [e.type for e in r.events] == [ET.ADD_ENGINE, ET.EVICT]
    new.append_token(10, now=104.0)
    new.append_token(11, now=105.0)
    with pytest.raises(ValueError, match="nothing left"):
        rec.checkpoint()
    m = rec.merge()
    assert m.tpot == [1.0, 2.0, 1.0] and m.ttft == 1.0
    assert m.prompt_log_probs == [-1.0, -2.0]
    assert m.sampling_params.num_tokens_to_generate == 4


def test_merge_prompt_log_probs_from_later_segment():
    rec = DynamicInferenceRequestRecord.from_request(make(tokens=[1, 2, 3], n=4))
    rec[0].append_token(4)
    rec.checkpoint()
    rec[1].prompt_log_probs = [-1.0, -2.0, -3.0]  # over [1, 2, 3, 4]: drop the generated suffix
    assert rec.merge().prompt_log_probs == [-1.0, -2.0]


def test_merge_generated_text_and_latency():
    rec = DynamicInferenceRequestRecord.from_request(make(n=4))
    rec[0].append_token(1)
    rec[0].generated_text = "a"
    rec.checkpoint().generated_text = "b"
    assert rec.merge().generated_text == "ab"
    rec[1].generated_text = None
    assert rec.merge().generated_text is None
    rec[1].latency = 3.0
    assert rec.merge().latency == 3.0
    rec.latency = 4.0
    assert rec.merge().latency == 4.0


def test_merge_keeps_segment_order_when_the_clock_steps_back():
    """Events are concatenated segment by segment as recorded: a clock that stepped back (or a
    segment from a host whose clock lags) must not reorder ADD, FAIL into FAIL, ADD."""
    rec = DynamicInferenceRequestRecord.from_request(make(n=4))
    rec[0].events += [
        DynamicInferenceEvent(ET.ADD_ENGINE, 5.0),
        DynamicInferenceEvent(ET.EVICT, 6.0),
    ]
    rec.checkpoint()
    rec[1].events += [
        DynamicInferenceEvent(ET.ADD_ENGINE, 3.0),
        DynamicInferenceEvent(ET.FAIL, 2.0),
    ]
    merged = rec.merge()
    assert [e.type for e in merged.events] == [ET.ADD_ENGINE, ET.EVICT, ET.ADD_ENGINE, ET.FAIL]
    assert [e.timestamp for e in merged.events] == [5.0, 6.0, 3.0, 2.0]
    assert DynamicInferenceRequestRecord.from_bytes(rec.to_bytes()).merge() == merged


def test_staleness_version_carried_by_checkpoint_merge_and_wire():
    rec = DynamicInferenceRequestRecord.from_request(make(n=4))
    rec[0].staleness_version = 3
    rec.checkpoint()
    assert rec[1].staleness_version == 3  # counters carried, so is what they are relative to
    rec[1].staleness_version = 5
    assert rec.merge().staleness_version == 5  # the segment that left the engine last
    back = DynamicInferenceRequestRecord.from_bytes(rec.to_bytes())
    assert [r.staleness_version for r in back.requests] == [3, 5] and back == rec
    with pytest.raises(ValueError, match="staleness_version"):
        DynamicInferenceRequest(1, staleness_version="5")


def test_staleness_counters_made_in_inference_mode_update_outside_it():
    """The engine checkpoints (evicts) inside torch.inference_mode and increments staleness in
    update_weights, outside it."""
    rec = DynamicInferenceRequestRecord.from_request(make(n=6))
    with torch.inference_mode():
        rec[0].append_token(1, weight_version=0)
        rec[0].reset_kv_staleness(0)
        rec[0].increment_staleness()
        rec.checkpoint()
        rec[-1].reset_kv_staleness(3)
    rec.increment_staleness()
    rec[-1].reset_kv_staleness(5)
    assert rec[-1].policy_staleness.tolist() == [2] * 6
    assert rec[-1].kv_cache_staleness.tolist() == [2, 2, 2, 1, 1, 0]


def test_failed_is_wider_than_the_status():
    """The documented differences between failed() and `status == FAILED`."""
    ok = make(n=2)
    ok.status = Status.COMPLETED
    assert ok.succeeded() and not ok.failed()
    evented = make(n=2)
    evented.status = Status.COMPLETED
    evented.add_event_error_nontransient(RuntimeError("lost"))  # error without a status change
    assert evented.failed()
    retried = make(n=2)
    retried.add_event_error_transient(RuntimeError("blip"))  # transient: it was retried
    retried.status = Status.COMPLETED
    assert retried.succeeded()
    rec = DynamicInferenceRequestRecord.from_request(make(n=4))
    rec[0].add_event_fail()
    rec.checkpoint()
    rec[1].status = Status.COMPLETED
    merged = rec.merge()
    assert merged.status == Status.COMPLETED and merged.failed()  # an earlier segment failed
    assert make(n=2).succeeded()  # still waiting: not failed, not finished either


def test_record_basics_and_errors():
    empty = DynamicInferenceRequestRecord()
    assert len(empty) == 0
    with pytest.raises(ValueError, match="empty"):
        empty.request_id  # noqa: B018
    with pytest.raises(ValueError, match="empty"):
        empty.merge()
    rec = DynamicInferenceRequestRecord.from_request(DynamicInferenceRequest(3))
    assert rec.request_id == 3 and rec[0] is rec[-1]
    with pytest.raises(ValueError, match="tokeniz"):
        rec.checkpoint()
