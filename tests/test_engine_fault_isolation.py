"""Fault isolation in the engine step: a poison request fails alone (its blocks freed), a step
that fails for no request's reason fails that step's requests, and the engine keeps serving
with exactly the tokens of a fault-free run."""

from __future__ import annotations

import pytest
import torch
from reference import greedy, tiny_model

from rollout.engine import DynamicInferenceEngine, InferenceConfig
from rollout.engine.engine import MAX_STEP_FAILURES_IN_A_ROW
from rollout.engine.errors import EngineBrokenError
from rollout.request import DynamicInferenceEventType, Status
from rollout.sampling import SamplingParams
from rollout.tokenizers import ByteTokenizer

GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
PROMPTS = [[1, 2, 3], [40, 41, 42, 43, 44], [7] * 19, [100, 90, 80, 70]]


def padded_model() -> torch.nn.Module:
    """Vocabulary 300 over a 259-id tokenizer (like Qwen2.5's padded embedding); the padding
    rows are silent except id 299, which the model prefers wherever it would emit 35."""
    m = tiny_model(seed=0, vocab_size=300, tie_word_embeddings=False)
    with torch.no_grad():
        w = m.lm_head.weight
        w[259:] = 0.0
        w[299] = 1.5 * w[35]
    return m


def make_engine(model, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return DynamicInferenceEngine(model, ByteTokenizer(), InferenceConfig(**kw))


def run(eng, records):
    """Step until every record finished; returns them by request id."""
    want = {r.request_id for r in records}
    done = {}
    for _ in range(200):
        for r in eng.step().finished:
            done[r.request_id] = r
        if want <= done.keys():
            return done
    raise AssertionError(f"requests {sorted(want - done.keys())} never finished")


def error_of(record_or_request) -> str:
    """The message of the last non-transient error event (records: of their last segment;
    merge() would re-validate the corrupted params)."""
    req = record_or_request
    req = req.requests[-1] if hasattr(req, "requests") else req
    errors = [e for e in req.events if e.type == DynamicInferenceEventType.ERROR_NONTRANSIENT]
    assert errors, "a failed record carries its error event"
    return errors[-1].payload["message"]


def tokens_of(record) -> list[int]:
    return [t for r in record.requests for t in r.generated_tokens]


POISONS = {  # field set on an admitted request's params (bypassing validation) -> failing stage
    "sampling": ("temperature", "hot"),
    "token bookkeeping": ("stop_token_ids", None),
    "scheduling": ("num_tokens_to_generate", None),
    "prompt log-probs": ("top_n_logprobs", "x"),
}


@pytest.mark.parametrize("stage", POISONS)
def test_poison_request_fails_alone_and_the_rest_is_exact(model, stage):
    field, value = POISONS[stage]
    eng = make_engine(model)
    healthy = [eng.add_request(None, p, GREEDY) for p in PROMPTS]
    poison_sp = GREEDY.replace(return_prompt_log_probs=True)
    poison = eng.add_request(None, [9, 8, 7, 6, 5], poison_sp)
    setattr(poison.requests[-1].sampling_params, field, value)  # admitted, then gone bad
    done = run(eng, [*healthy, poison])

    bad = done[poison.request_id]
    assert bad.requests[-1].status == Status.FAILED
    assert f"{stage} failed" in error_of(bad)
    for rec, prompt in zip(healthy, PROMPTS, strict=True):
        got = done[rec.request_id].merge()
        assert got.status == Status.COMPLETED
        assert got.generated_tokens == greedy(model, prompt, 6)
    assert eng.blocks.num_used == 0  # the poison's blocks went back too
    stats = eng.stats()
    assert (stats["request_faults"], stats["requests_failed"], stats["step_failures"]) == (1, 1, 0)
    after = eng.generate([PROMPTS[0]], GREEDY)[0]  # still serving
    assert after.generated_tokens == greedy(model, PROMPTS[0], 6)


def test_corrupted_params_are_refused_on_admission(model):
    sp = GREEDY.replace()
    sp.top_k = 2**63
    eng = make_engine(model)
    rec = eng.add_request(None, PROMPTS[0], sp)
    assert rec.requests[-1].status == Status.FAILED
    assert "top_k" in error_of(rec) and str(2**63) in error_of(rec)


def test_top_k_past_the_vocabulary_is_no_filter_in_flight():
    """top_k=2**63 overflowed inside the step and killed the engine; a top_k past the
    vocabulary filters nothing, so such a request is served like top_k=0. Batch-invariant (on
    a private model: the mode is set on it): the twin sits in another row of the batch, and
    only this mode guarantees a row the same logits wherever it sits."""
    eng = make_engine(tiny_model(), batch_invariant=True)
    sp = SamplingParams(temperature=0.8, seed=7, num_tokens_to_generate=6, ignore_eos=True)
    rec = eng.add_request(None, PROMPTS[1], sp)
    other = eng.add_request(None, PROMPTS[1], sp)
    eng.step()
    rec.requests[-1].sampling_params.top_k = 2**63
    done = run(eng, [rec, other])
    assert tokens_of(done[rec.request_id]) == tokens_of(done[other.request_id])
    assert eng.stats()["request_faults"] == 0


def test_unexplained_step_failure_fails_that_step_and_the_engine_goes_on(model, monkeypatch):
    eng = make_engine(model, max_requests=3)
    recs = [eng.add_request(None, p, GREEDY) for p in PROMPTS]  # the 4th waits for a slot
    eng.step()
    eng.step()
    in_step = [r for r in recs if eng._seqs[r.request_id] in eng.scheduler.running]
    assert len(in_step) == 3 and eng.blocks.num_used > 0
    real = eng.runner.logits
    calls = []

    def broken_once(prep, kv, *args, **kwargs):
        calls.append(prep.num_tokens)
        if len(calls) == 1:
            raise RuntimeError("device hiccup")
        return real(prep, kv, *args, **kwargs)

    monkeypatch.setattr(eng.runner, "logits", broken_once)
    out = eng.step()
    failed = {r.request_id for r in out.finished}
    assert failed == {r.request_id for r in in_step}
    for r in out.finished:
        assert r.requests[-1].status == Status.FAILED
        assert "engine step (no single request explains it) failed" in error_of(r)
        assert "device hiccup" in error_of(r)
    stats = eng.stats()
    assert (stats["step_failures"], stats["requests_failed"]) == (1, 3)
    waiting = next(r for r in recs if r not in in_step)
    done = run(eng, [waiting])  # the request that was not in that step is served exactly
    assert done[waiting.request_id].merge().generated_tokens == greedy(model, PROMPTS[3], 6)
    assert eng.blocks.num_used == 0
    assert eng.generate([PROMPTS[0]], GREEDY)[0].generated_tokens == greedy(model, PROMPTS[0], 6)


def test_steps_failing_in_a_row_raise_engine_broken_and_lose_no_record(model, monkeypatch):
    eng = make_engine(model)

    def broken(prep, kv):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(eng.runner, "logits", broken)
    early = eng.add_request(None, [], GREEDY)  # rejected: its record waits for the next step
    for i in range(MAX_STEP_FAILURES_IN_A_ROW - 1):
        eng.add_request(None, PROMPTS[i], GREEDY)
        assert eng.step().finished  # failed, not raised
    eng.add_request(None, PROMPTS[0], GREEDY)
    with pytest.raises(EngineBrokenError, match="in a row"):
        eng.step()
    assert eng.stats()["step_failures"] == MAX_STEP_FAILURES_IN_A_ROW
    monkeypatch.undo()
    finished = eng.step().finished  # the failed records of the last step are not lost
    assert len(finished) == 1 and finished[0].requests[-1].status == Status.FAILED
    assert early.requests[-1].status == Status.FAILED
    assert eng.blocks.num_used == 0


def test_ids_past_the_tokenizer_become_replacement_text(model):
    """Finding 2: an id the tokenizer cannot decode ended the engine; now it is U+FFFD in
    generated_text and the ids are the model's exactly."""
    padded = padded_model()
    tok = ByteTokenizer()
    eng = make_engine(padded)
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44], [7] * 19, [100, 90, 80, 70], [5, 6]]
    out = eng.generate(prompts, GREEDY)
    expected = [greedy(padded, p, 6) for p in prompts]
    assert any(299 in ids for ids in expected), "the test model must emit an out-of-tokenizer id"
    assert any(299 not in ids for ids in expected)
    for r, ids in zip(out, expected, strict=True):
        assert r.status == Status.COMPLETED and r.generated_tokens == ids
        assert r.generated_text == tok.decode(ids)
        assert r.generated_text.count("\ufffd") >= ids.count(299)
    assert eng.stats()["requests_failed"] == 0


class StrictTokenizer(ByteTokenizer):
    """A foreign tokenizer whose decode raises for one exact token sequence."""

    def __init__(self, poison: list[int]) -> None:
        self.poison = poison

    def decode(self, ids, skip_special_tokens=True):
        if list(ids) == self.poison:
            raise ValueError("cannot decode this")
        return super().decode(ids, skip_special_tokens)


def test_detokenization_fault_fails_that_request_only(model):
    expected = [greedy(model, p, 6) for p in PROMPTS]
    tok = StrictTokenizer(poison=expected[2])
    eng = DynamicInferenceEngine(model, tok, InferenceConfig(num_blocks=64, block_size=4))
    out = eng.generate(PROMPTS, GREEDY)
    assert [r.status for r in out] == [Status.COMPLETED] * 2 + [Status.FAILED, Status.COMPLETED]
    assert "detokenization failed: ValueError: cannot decode this" in error_of(out[2])
    assert [out[i].generated_tokens for i in (0, 1, 3)] == [expected[i] for i in (0, 1, 3)]
    assert eng.blocks.num_used == 0 and not eng.has_unfinished_requests()


def test_generate_that_raises_leaves_nothing_behind(model, monkeypatch):
    eng = make_engine(model)

    def interrupted():
        raise KeyboardInterrupt

    eng.step()  # nothing to do
    monkeypatch.setattr(eng, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert not eng.has_unfinished_requests() and eng.blocks.num_used == 0
