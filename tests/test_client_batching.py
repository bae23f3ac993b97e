"""InferenceClient send path: submissions made in one loop turn leave as one SUBMIT_BATCH frame,
and every other message (abort, control, stop) stays ordered after them."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import Harness, expected_tokens

from rollout.protocol import Headers, ProtocolError, decode, encode, pack_tokens
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient
from rollout.serving.client_errors import ClientStopped, RequestFailed

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def harness():
    h = Harness()
    h.add_engine(0)
    h.add_engine(1)
    h.wait_engines(2)
    yield h
    h.close()


@pytest.fixture
async def client(harness):
    c = await InferenceClient(harness.address, auth_token=harness.auth_token).start()
    yield c
    c.stop()  # also on failure: an open socket would block zmq's context at exit


def _submits(sent: list[bytes]) -> list[tuple[Headers, list]]:
    """The submission frames among those sent (heartbeats may go out meanwhile)."""
    out = [decode(f) for f in sent]
    return [(h, f) for h, f in out if h in (Headers.SUBMIT_REQUEST, Headers.SUBMIT_BATCH)]


async def test_burst_goes_out_batched_and_every_request_resolves(client):
    sent: list[bytes] = []
    real_send = client._sock.send
    client._sock.send = lambda frame, flags=0: (sent.append(frame), real_send(frame, flags))[1]
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=4)
    prompts = [[i, i + 2, i + 5] for i in range(600)]  # > 2 * MAX_BATCH_ROWS rows in one turn
    futs = [client.add_request(p, sp) for p in prompts]
    assert len(sent) == 1  # the first leaves at once, the rest wait for the end of the turn
    records = await asyncio.gather(*futs)
    frames = _submits(sent)
    headers = [h for h, _ in frames]
    assert headers == [Headers.SUBMIT_REQUEST] + [Headers.SUBMIT_BATCH] * 3  # 599 = 256+256+87
    (_, first), *batches = frames
    rows = [first] + [r for _, b in batches for r in b[0]]
    assert [r[0] for r in rows] == [f.request_id for f in futs]
    for p, rec in zip(prompts, records, strict=True):
        assert rec.merge().generated_tokens == expected_tokens(p, 4)
    # a lone request goes as a plain SUBMIT_REQUEST
    sent.clear()
    await client.add_request([1, 2, 3], sp)
    assert [h for h, _ in _submits(sent)] == [Headers.SUBMIT_REQUEST]
    stats = await client.stats()
    assert stats["counters"]["requests"] == 601 and stats["pending_requests"] == 0


async def test_abort_right_after_submit_is_ordered_behind_it(client):
    fut = client.add_request([9, 9], SamplingParams(num_tokens_to_generate=100_000))
    client.abort(fut)  # same loop turn: the abort must not overtake the queued submission
    rec = await asyncio.wait_for(fut, 10)
    assert rec.merge().stop_reason == "abort"


async def test_bad_rows_in_a_batch_fail_only_their_own_request(client):
    sp = SamplingParams(num_tokens_to_generate=2)
    good = client.add_request([1, 2], sp)
    bad = client.add_request([3, 4], sp)
    row = client._outbox[0][0]  # the first request already left; the second is queued
    row[3] = 0  # num_tokens_to_generate < 1: the coordinator refuses just this row
    with pytest.raises(RequestFailed, match=r"num_tokens_to_generate must be in \[1, 2147483647\]"):
        await bad
    assert (await good).merge().generated_tokens == expected_tokens([1, 2], 2)


async def test_stop_fails_queued_submissions_without_sending_them(client):
    fut = client.add_request([1, 2, 3], SamplingParams(num_tokens_to_generate=2))
    client.stop()
    with pytest.raises(ClientStopped):
        await fut
    await asyncio.sleep(0)  # the scheduled flush runs and must do nothing
    with pytest.raises(ClientStopped):
        client.add_request([1], SamplingParams())


def test_submit_batch_schema_checks_every_row():
    sp = b"\x80"
    frame = encode(Headers.SUBMIT_BATCH, [[1, pack_tokens([1, 2]), sp, 3, False, None, None]])
    assert decode(frame)[0] is Headers.SUBMIT_BATCH
    with pytest.raises(ProtocolError, match=r"requests\[1\]\.num_tokens_to_generate must be int"):
        encode(
            Headers.SUBMIT_BATCH,
            [[1, b"\0" * 4, sp, 3, False, None, None], [2, b"\0" * 4, sp, "3", False, None, None]],
        )


def test_pack_tokens_fast_path_matches_numpy():
    import numpy as np

    toks = [0, 5, -3, 2**31 - 1, -(2**31), np.int64(7)]
    assert pack_tokens(toks) == np.asarray([int(t) for t in toks], dtype="<i4").tobytes()
    assert pack_tokens(tuple(toks)) == pack_tokens(toks)


@pytest.mark.parametrize(
    "bad, match",
    [
        ([2**31], "fit in int32"),
        ([1, 2.5], "integers"),
        ([True, False], "integers"),
        ([[1, 2], [3, 4]], "1-D"),
    ],
    ids=["over-int32", "float", "bools", "nested-lists"],
)
def test_pack_tokens_fast_path_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_tokens(bad)


async def test_start_freezes_the_startup_heap_unless_told_not_to(harness):
    """Objects alive at start() leave the cyclic GC's reach (rollout.serving.gc_tuning); opt-out works."""
    import gc

    gc.unfreeze()
    try:
        c = await InferenceClient(
            harness.address, auth_token=harness.auth_token, freeze_gc=False
        ).start()
        c.stop()
        assert gc.get_freeze_count() == 0
        marker = [object()]  # alive before start(): must end up frozen
        c = await InferenceClient(harness.address, auth_token=harness.auth_token).start()
        c.stop()
        assert gc.get_freeze_count() > 0
        assert all(o is not marker for o in gc.get_objects())  # frozen: no collection sees it
    finally:
        gc.unfreeze()


async def test_a_submitted_batch_reaches_each_engine_as_one_dispatch_frame():
    """The coordinator forwards a SUBMIT_BATCH's rows to an engine in one DISPATCH_BATCH frame
    (counted at a bare engine socket), and the replies still resolve every future."""
    import torch
    import zmq

    from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord

    h = Harness()
    ctx = zmq.Context()
    eng = ctx.socket(zmq.DEALER)
    eng.setsockopt(zmq.LINGER, 0)
    eng.connect(h.address)
    eng.send(
        encode(
            Headers.ENGINE_REGISTER, 0, 1 << 20, 0, h.auth_token, 16, {"architecture": "raw"}, True
        )
    )
    assert eng.poll(5000) and decode(eng.recv())[0] is Headers.ENGINE_REGISTER_ACK
    client = await InferenceClient(h.address, auth_token=h.auth_token).start()
    try:
        sp = SamplingParams(num_tokens_to_generate=1)
        futs = [client.add_request([i + 1, i + 2], sp) for i in range(10)]
        frames: list[tuple[Headers, list]] = []
        rows: list[list] = []
        while len(rows) < 10:
            assert await asyncio.to_thread(eng.poll, 5000), f"only {len(rows)} of 10 dispatched"
            header, fields = decode(eng.recv())
            if header in (Headers.DISPATCH_REQUEST, Headers.DISPATCH_BATCH):
                frames.append((header, fields))
                rows.extend([fields] if header is Headers.DISPATCH_REQUEST else fields[0])
        # the turn's first request leaves alone, the other nine as one batch, one frame
        assert [h_ for h_, _ in frames] == [Headers.DISPATCH_REQUEST, Headers.DISPATCH_BATCH]
        replies = []
        for row in rows:
            req = DynamicInferenceRequest(request_id=row[0], prompt_tokens=torch.tensor([1, 2]))
            req.append_token(7, None, None, 0)
            replies.append([row[0], DynamicInferenceRequestRecord.from_request(req).to_bytes()])
        eng.send(encode(Headers.REPLY, replies))
        records = await asyncio.wait_for(asyncio.gather(*futs), 10)
        assert [r.merge().generated_tokens for r in records] == [[7]] * 10
    finally:
        client.stop()
        eng.close(0)
        ctx.term()
        h.close()


def test_dispatch_batch_schema_checks_every_row():
    row = [1, pack_tokens([1, 2]), b"\x80", b"", b"", b"", b"", False, b""]
    assert decode(encode(Headers.DISPATCH_BATCH, [row, row]))[0] is Headers.DISPATCH_BATCH
    with pytest.raises(ProtocolError, match=r"requests\[1\]\.stream must be bool"):
        encode(Headers.DISPATCH_BATCH, [row, [*row[:-2], 1, b""]])


@pytest.mark.parametrize("bad_at", [0, 4])  # the turn's first (sent at once) or a queued one
async def test_unencodable_prompt_in_a_burst_fails_alone_at_once(client, bad_at):
    sp = SamplingParams(num_tokens_to_generate=3)
    prompts = [f"ok {i}" for i in range(10)]
    prompts[bad_at] = "bad\ud800"  # a lone surrogate: no UTF-8 encoding exists
    futs, errors = {}, []
    for i, p in enumerate(prompts):
        try:
            futs[i] = client.add_request(p, sp)
        except ValueError as e:
            errors.append((i, str(e)))
    assert errors == [(bad_at, "prompt is not valid UTF-8 text (surrogates not allowed at "
                                "index 3: '\\ud800')")]  # fmt: skip
    records = await asyncio.wait_for(asyncio.gather(*futs.values()), 10)
    assert len(records) == 9 and all(r.merge().generated_tokens for r in records)
    assert client.pending() == 0
    with pytest.raises(ValueError, match="sampling_params cannot be sent"):
        client.add_request("fine", SamplingParams(stop_words=["x\udfff"]))
    assert client.pending() == 0


async def test_a_queued_row_that_cannot_be_encoded_fails_only_its_own_future(client):
    """Should a row still fail to encode when the turn's batch is sent, that row's future fails
    with the reason and the rest of the batch goes out."""
    sp = SamplingParams(num_tokens_to_generate=2)
    futs = [client.add_request([i + 1, 7], sp) for i in range(5)]
    client._outbox[1][0][1] = "bad\ud800"  # futs[2]: corrupted after add_request checked it
    with pytest.raises(RequestFailed, match=r"request \d+: cannot be sent: .*surrogates"):
        await asyncio.wait_for(futs[2], 10)
    others = await asyncio.wait_for(asyncio.gather(*(futs[:2] + futs[3:])), 10)
    assert [r.merge().generated_tokens for r in others] == [
        expected_tokens([i + 1, 7], 2) for i in (0, 1, 3, 4)
    ]
    assert client.pending() == 0


async def test_a_control_that_cannot_be_sent_leaves_nothing_pending(client):
    with pytest.raises(ProtocolError, match="SUSPEND: field 'mode' must be str"):
        client.suspend_engines(mode=3)
    client.stop()
    with pytest.raises(ClientStopped):
        client.pause_engines()
    with pytest.raises(ClientStopped):
        client.stats()
    assert not client._controls and not client._stats
