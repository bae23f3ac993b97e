"""InferenceConfig.async_scheduling (rollout.engine.overlap): the host lags the device by one
decode step, and nothing a caller sees changes. Every scenario runs the same script of steps
and lifecycle calls with the option off and on and compares tokens, log-probs, top-n, weight
versions, finish reasons and texts request by request, bit for bit. The two runs' batches
differ (a step after a request finished holds its discarded extra row), and in default mode a
batch of another size may round a matmul differently, so a greedy near tie or a seeded draw at a
CDF boundary could go another way on another CPU: the comparisons run batch-invariant
(InferenceConfig(batch_invariant=True)), where a row's bits do not depend on its batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from id_tokenizer import IdTokenizer
from reference import tiny_model

from rollout.engine import DynamicInferenceEngine, InferenceConfig, sampler
from rollout.engine.cuda_graphs import DecodeGraphs
from rollout.request import DynamicInferenceEventType, Status
from rollout.sampling import SamplingParams

PROMPTS = [[5, 6, 7], list(range(10, 40)), [200], list(range(60, 77)), [9, 9, 9, 9, 9]]
Event = Callable[[DynamicInferenceEngine, list[int]], None]


def _params(i: int, n: int = 20, **kw) -> SamplingParams:
    greedy = i % 2 == 0
    return SamplingParams(temperature=0.0 if greedy else 0.9, top_k=0 if greedy else 40,
                          seed=None if greedy else 100 + i, num_tokens_to_generate=n + 3 * i,
                          ignore_eos=True, return_log_probs=True,
                          top_n_logprobs=2 if i == 1 else 0, **kw)  # fmt: skip


def _run(
    async_scheduling: bool,
    params: list[SamplingParams],
    events: dict[int, Event] | None = None,
    graphs: bool = False,
    **kw,
) -> tuple[list[tuple], DynamicInferenceEngine, int]:
    kw.setdefault("num_blocks", 256)
    config = InferenceConfig(async_scheduling=async_scheduling, batch_invariant=True, **kw)
    model = tiny_model(seed=0)
    eng = DynamicInferenceEngine(model, IdTokenizer(), config)
    if graphs:  # the graph path's static forward, run eagerly on CPU (tests/test_cuda_graphs.py)
        max_blocks = -(-config.max_sequence_length // config.block_size)
        eng.runner.graphs = DecodeGraphs(model, config.max_requests, max_blocks,
                                         torch.device("cpu"), capture=False)  # fmt: skip
    ids = [eng.add_request(None, p, sp).request_id for p, sp in zip(PROMPTS, params, strict=False)]
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        out = eng.step()
        steps += 1
        for record in out.finished:
            done[record.request_id] = record.merge()
        if events and steps in events:
            events[steps](eng, ids)
        assert steps < 1000, "engine stalled"
    rows = []
    for i in ids:
        r = done[i]
        rows.append((list(r.generated_tokens), r.generated_log_probs, r.generated_top_n_logprobs,
                     r.generated_weight_versions, r.stop_reason, r.generated_text,
                     r.status, _listed(r.policy_staleness),
                     _listed(r.kv_cache_staleness)))  # fmt: skip
    return rows, eng, steps


def _listed(t) -> list | None:
    return None if t is None else t.tolist()


def _assert_same(on: list[tuple], off: list[tuple]) -> None:
    for a, b in zip(on, off, strict=True):
        assert a[0] == b[0] and a[3:] == b[3:]  # tokens, versions, reason, text, status, staleness
        assert a[1] == b[1]  # log-probs: the same floats
        assert [list(d.items()) for d in a[2]] == [list(d.items()) for d in b[2]]


def _same(params: list[SamplingParams], events: dict[int, Event] | None = None, **kw) -> list:
    off, _, _ = _run(False, params, events, **kw)
    on, eng, _ = _run(True, params, events, **kw)
    _assert_same(on, off)
    assert eng.stats()["overlapped_steps"] > 0
    return off


def test_outputs_match_and_one_sync_per_step(monkeypatch):
    """Plain decoding: identical outputs; most steps overlap (counted on the sampler's
    device-to-host read) and no step reads the device more than once."""
    reads = []
    real = sampler.to_host
    monkeypatch.setattr(sampler, "to_host", lambda s: reads.append(1) or real(s))
    params = [_params(i) for i in range(len(PROMPTS))]
    off, _, _ = _run(False, params)
    reads.clear()
    per_step = []
    on, eng, _ = _run(True, [_params(i) for i in range(len(PROMPTS))])
    _assert_same(on, off)
    assert len(reads) <= eng.stats()["steps"] + 1  # at most one read per step (and the last)
    eng2 = DynamicInferenceEngine(tiny_model(seed=0), IdTokenizer(),
                                  InferenceConfig(num_blocks=256, async_scheduling=True))  # fmt: skip
    eng2.add_request(None, PROMPTS[1], _params(0, n=30))
    while eng2.has_unfinished_requests():
        before = len(reads)
        eng2.step()
        per_step.append(len(reads) - before)
    assert max(per_step) == 1
    assert per_step[:2] == [1, 0]  # the prefill samples synchronously; the first decode flies
    # 29 decodes: the scheduler launches the first and the one that needs a new block (position
    # 32); every other one overlaps the read of the step before it
    assert eng2.stats()["overlapped_steps"] == 27


def test_stop_tokens_stop_words_and_max_tokens():
    """A request that stops on a token, a stop word or its length had one more token
    computed by the overlapped step: it is dropped, and the others are untouched."""
    free, _, _ = _run(False, [_params(i) for i in range(len(PROMPTS))])
    stop_tok = free[0][0][4]
    words = " ".join(str(t) for t in free[3][0][6:8])
    params = [_params(i) for i in range(len(PROMPTS))]
    params[0] = _params(0, stop_token_ids=[stop_tok])
    params[3] = _params(3, stop_words=[words])
    params[4] = _params(4, n=1)
    rows = _same(params)
    assert rows[0][4] == "stop_token" and rows[0][0][-1] == stop_tok
    assert rows[3][4] == "stop_word" and words not in rows[3][5]


def test_evictions_under_a_small_pool():
    rows = _same([_params(i, n=40) for i in range(len(PROMPTS))], block_size=4, num_blocks=24)
    assert all(r[4] == "length" for r in rows)


def test_abort_mid_generation():
    events = {6: lambda eng, ids: eng.abort(ids[1]), 9: lambda eng, ids: eng.abort(ids[2])}
    rows = _same([_params(i) for i in range(len(PROMPTS))], events)
    assert rows[1][4] == rows[2][4] == "abort" and 0 < len(rows[1][0]) < 23


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_weight_update_between_steps_keeps_versions_exact(policy):
    new = tiny_model(seed=1).state_dict()
    events = {7: lambda eng, ids: eng.update_weights(new, version=1)}
    rows = _same([_params(i) for i in range(len(PROMPTS))], events, kv_policy=policy)
    versions = rows[1][3]
    assert versions[0] == 0 and versions[-1] == 1


def test_staged_flip_between_steps_keeps_versions_exact():
    def flip(eng: DynamicInferenceEngine, ids: list[int]) -> None:
        staged = eng.stage_weights(tiny_model(seed=1).state_dict(), 1)
        with eng.weight_stage.hold():
            eng.flip_weights(staged)

    rows = _same([_params(i) for i in range(len(PROMPTS))], {5: flip})
    assert rows[2][3][:3] == [0, 0, 0] and rows[2][3][-1] == 1


def test_graph_decode_path_takes_the_device_side_tokens():
    """The decode graphs' input buffer is written from the previous step's samples."""
    params = [_params(i) for i in range(len(PROMPTS))]
    off, _, _ = _run(False, params)
    on, eng, _ = _run(True, params, graphs=True)
    _assert_same(on, off)
    stats = eng.stats()
    assert (
        stats["overlapped_steps"] > 10 and stats["decode_graph_eager"] >= stats["overlapped_steps"]
    )


@pytest.mark.parametrize("mode", ["persist", "offload", "recompute"])
def test_suspend_resume(mode):
    """Suspend drains the in-flight step: while suspended, every record already holds each
    token computed so far (what a trainer inspecting them expects), as without the option."""
    seen: dict[bool, list[int]] = {}

    def run(async_scheduling: bool) -> list[tuple]:
        def suspend_and_resume(eng: DynamicInferenceEngine, ids: list[int]) -> None:
            eng.suspend(mode)
            seen[async_scheduling] = [len(eng._seqs[i].request.generated_tokens) for i in ids]
            eng.resume()

        params = [_params(i) for i in range(len(PROMPTS))]
        return _run(async_scheduling, params, {8: suspend_and_resume})[0]

    off, on = run(False), run(True)
    _assert_same(on, off)
    assert seen[True] == seen[False] and min(seen[True]) > 0
    assert all(r[4] == "length" for r in on)


def test_streaming_partials_match():
    """Partials carry the same tokens, in order, whether or not the host lags."""

    def partial_tokens(async_scheduling: bool) -> dict[int, list[int]]:
        config = InferenceConfig(num_blocks=256, streaming_interval=3, batch_invariant=True,
                                 async_scheduling=async_scheduling)  # fmt: skip
        eng = DynamicInferenceEngine(tiny_model(seed=0), IdTokenizer(), config)
        for p in PROMPTS[:3]:
            eng.add_request(None, p, _params(0))
        got: dict[int, list[int]] = {}
        while eng.has_unfinished_requests():
            for part in eng.step().partials:
                got.setdefault(part[0], []).extend(part[1])
        return got

    assert partial_tokens(True) == partial_tokens(False)


def test_option_is_checked():
    with pytest.raises(ValueError, match="async_scheduling"):
        InferenceConfig(async_scheduling="yes")


def test_a_failed_read_fails_the_in_flight_requests_only(monkeypatch):
    """A device fault surfacing at the read fails the requests whose token it held (their last
    token is lost) with a RequestFault, and the engine serves the next request."""
    eng = DynamicInferenceEngine(tiny_model(seed=0), IdTokenizer(),
                                 InferenceConfig(num_blocks=256, async_scheduling=True))  # fmt: skip
    rid = eng.add_request(None, PROMPTS[0], _params(0)).request_id
    for _ in range(3):
        eng.step()
    assert eng._inflight is not None
    real = sampler.to_host

    def broken(sample):
        monkeypatch.setattr(sampler, "to_host", real)
        raise RuntimeError("device lost")

    monkeypatch.setattr(sampler, "to_host", broken)
    finished = eng.step().finished
    assert [r.request_id for r in finished] == [rid]
    req = finished[0].requests[-1]
    assert req.status == Status.FAILED
    errors = [e for e in req.events if e.type == DynamicInferenceEventType.ERROR_NONTRANSIENT]
    assert "reading the in-flight step failed" in errors[-1].payload["message"]
    assert eng.generate([PROMPTS[1]], _params(0, n=4))[0].stop_reason == "length"
