"""Structured outputs in the engine (xgrammar): every answer follows its grammar, on the tiny
random byte model that does not produce JSON by itself, and a request's grammar state survives
eviction, recompute after a weight update and re-admission of its record on another engine
(the matcher is re-advanced over the tokens it has): seeded tokens equal an uninterrupted run.
Those comparisons run batch-invariant (`exact_engine`): the two runs' batches and prefills
differ, and in default mode a seeded draw at a CDF boundary could then go another way."""

from __future__ import annotations

import json
import re

import pytest
import torch
from reference import tiny_model

from rollout.engine import DynamicInferenceEngine, InferenceConfig, grammar
from rollout.request import Status
from rollout.sampling import SamplingParams
from rollout.structured_outputs import check_spec
from rollout.tokenizers import ByteTokenizer

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},  # (xgrammar's maxLength
        # strings admit raw control characters, which strict JSON parsers refuse)
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
PROMPTS = [[72, 105, 33], [1, 2, 3, 4, 5, 6, 7], [100] * 11, [40, 41]]
TOK = ByteTokenizer()


def sp(spec: dict, seed: int, **kw) -> SamplingParams:
    kw = {"temperature": 1.0, "num_tokens_to_generate": 100, "return_log_probs": True, **kw}
    return SamplingParams(seed=seed, structured_outputs=spec, **kw)


def engine(model, **kw) -> DynamicInferenceEngine:
    kw = {"block_size": 4, "num_blocks": 256, **kw}
    return DynamicInferenceEngine(model, TOK, InferenceConfig(**kw))


def exact_engine(**kw) -> DynamicInferenceEngine:
    """A batch-invariant engine (same bits whatever the batch) on its own tiny model (the mode
    is set on the model, so not on the module's shared one)."""
    return engine(tiny_model(seed=0), batch_invariant=True, **kw)


def text(req) -> str:
    ids = [t for t in req.generated_tokens if t < 256]
    return bytes(ids).decode("utf-8")


def run(eng, ids=None) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        for rec in eng.step().finished:
            done[rec.request_id] = rec.merge()
    return done


def failure(req) -> str:
    return " ".join(str(e.payload) for e in req.events)


def valid(req) -> dict:
    assert req.status == Status.COMPLETED and req.stop_reason == "eos", req.stop_reason
    obj = json.loads(text(req))
    jsonschema.validate(obj, SCHEMA)
    return obj


def test_json_schema_answers_validate_and_unconstrained_ones_do_not(model):
    eng = engine(model)
    for i, p in enumerate(PROMPTS):
        eng.add_request(i, p, sp({"json": SCHEMA}, seed=i))
        eng.add_request(100 + i, p, SamplingParams(num_tokens_to_generate=60, seed=i))
    done = run(eng)
    for i in range(len(PROMPTS)):
        valid(done[i])
        free = bytes(t for t in done[100 + i].generated_tokens if t < 256)
        with pytest.raises(ValueError):  # the model alone writes no JSON
            json.loads(free.decode("utf-8", errors="replace"))


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2}", s)),
        ({"choice": ["yes", "no", "maybe"]}, lambda s: s in ("yes", "no", "maybe")),
        ({"json_object": True}, lambda s: isinstance(json.loads(s), dict)),
        ({"grammar": 'root ::= "x" ("ab" | "cd")+ "y"'}, lambda s: re.fullmatch(r"x(ab|cd)+y", s)),
    ],
)
def test_regex_choice_object_and_grammar(model, spec, check):
    eng = engine(model)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(i, p, sp(spec, seed=7 + i))
    for req in run(eng).values():
        assert req.stop_reason in ("eos", "length")
        if spec.get("json_object") and req.stop_reason == "length":
            continue  # an unbounded object can run out of tokens; its prefix is still JSON
        assert check(text(req)), text(req)


def test_logprobs_processed_are_of_the_masked_distribution_raw_of_the_model():
    spec = {"choice": ["yes", "no"]}
    eng = exact_engine()  # two rows of one batch: the same bits wherever a row sits
    model = eng.model
    eng.add_request(0, [5, 6, 7], sp(spec, 3, top_n_logprobs=4, logprobs_mode="processed"))
    eng.add_request(1, [5, 6, 7], sp(spec, 3, top_n_logprobs=4, logprobs_mode="raw"))
    done = run(eng)
    processed, raw = done[0], done[1]
    assert processed.generated_tokens == raw.generated_tokens  # the mode changes no sample
    first = processed.generated_top_n_logprobs[0]
    assert set(first) == {ord("y"), ord("n")}  # only the grammar's tokens have mass
    assert sum(torch.tensor(list(first.values())).exp()) == pytest.approx(1.0, abs=1e-5)
    logits = model(torch.tensor([[5, 6, 7]]))[0, -1].float()
    want_raw = torch.log_softmax(logits, -1)
    tok = processed.generated_tokens[0]
    assert raw.generated_log_probs[0] == pytest.approx(want_raw[tok].item(), abs=1e-4)
    allowed = want_raw[[ord("y"), ord("n")]]
    want_processed = want_raw[tok] - torch.logsumexp(allowed, 0)
    assert processed.generated_log_probs[0] == pytest.approx(want_processed.item(), abs=1e-4)


@pytest.mark.heavy  # batch-invariant decode of JSON: over 10 s here
def test_survives_eviction_with_the_same_tokens():
    spec = {"json": SCHEMA}
    ref = exact_engine()
    for i, p in enumerate(PROMPTS):
        ref.add_request(i, p, sp(spec, seed=i))
    want = run(ref)
    tight = exact_engine(num_blocks=32, max_requests=4)  # too few blocks for all four at once
    for i, p in enumerate(PROMPTS):
        tight.add_request(i, p, sp(spec, seed=i))
    got = run(tight)
    assert tight.stats()["evictions"] > 0
    for i in range(len(PROMPTS)):
        valid(got[i])
        assert got[i].generated_tokens == want[i].generated_tokens
        assert got[i].generated_log_probs == want[i].generated_log_probs


def test_survives_a_weight_update_with_recompute(model):
    spec = {"json": SCHEMA}
    new = tiny_model(seed=1).state_dict()
    eng = engine(tiny_model(seed=0), kv_policy="recompute")
    for i, p in enumerate(PROMPTS):
        eng.add_request(i, p, sp(spec, seed=i))
    done = {}
    for _ in range(6):
        for rec in eng.step().finished:
            done[rec.request_id] = rec.merge()
    assert eng.scheduler.running  # mid-generation
    eng.update_weights(new, 1)
    done.update(run(eng))
    for req in done.values():
        valid(req)
    assert any(set(r.generated_weight_versions) == {0, 1} for r in done.values())


@pytest.mark.heavy  # batch-invariant decode of JSON: over 10 s here
def test_a_checkpointed_record_resumes_on_another_engine_with_the_same_tokens():
    spec = {"json": SCHEMA}
    want = run(_with(exact_engine(), spec))
    first = _with(exact_engine(), spec)
    for _ in range(8):
        assert not first.step().finished
    records = [first._seqs[i].record for i in range(len(PROMPTS))]
    assert all(r.requests[-1].generated_tokens for r in records)
    second = exact_engine()  # a re-dispatch: the record alone, a fresh matcher re-advanced
    for rec in records:
        first.discard(rec.request_id)
        second.add_request(None, record=rec)
    got = run(second)
    for i in range(len(PROMPTS)):
        valid(got[i])
        assert got[i].generated_tokens == want[i].generated_tokens
        assert got[i].generated_log_probs == want[i].generated_log_probs


def _with(eng, spec):
    for i, p in enumerate(PROMPTS):
        eng.add_request(i, p, sp(spec, seed=i))
    return eng


def test_a_record_whose_tokens_leave_the_grammar_fails_alone(model):
    eng = engine(model)
    eng.add_request(0, [1, 2], SamplingParams(num_tokens_to_generate=4, seed=0))
    rec = run(eng)[0]
    bad = eng.add_request(None, [1, 2], sp({"choice": ["yes"]}, 0))
    assert bad.requests[-1].status != Status.FAILED  # a fresh request is fine
    run(eng)
    resumed = _record_with_tokens(rec, [ord("x")], {"choice": ["yes"]})
    out = engine(model).add_request(None, record=resumed)
    assert out.requests[-1].status == Status.FAILED
    assert "structured_outputs" in failure(out.requests[-1])


def _record_with_tokens(rec, tokens, spec):
    from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord

    req = DynamicInferenceRequest(request_id=50, prompt=None, prompt_tokens=torch.tensor([1, 2]),
                                  sampling_params=sp(spec, 0))  # fmt: skip
    req.generated_tokens = list(tokens)
    req.generated_log_probs = [0.0] * len(tokens)
    return DynamicInferenceRequestRecord.from_request(req)


def test_bad_specs_raise_naming_the_field():
    with pytest.raises(ValueError, match=r"structured_outputs must set exactly one"):
        SamplingParams(structured_outputs={"json": SCHEMA, "regex": "a"})
    with pytest.raises(ValueError, match=r"structured_outputs\.jsn is not"):
        SamplingParams(structured_outputs={"jsn": SCHEMA})
    with pytest.raises(ValueError, match=r"structured_outputs\.choice must"):
        SamplingParams(structured_outputs={"choice": "yes"})
    with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid JSON"):
        SamplingParams(structured_outputs={"json": "{nope"})
    with pytest.raises(ValueError, match=r"structured_outputs\.regex does not compile"):
        grammar.check(check_spec({"regex": "(unclosed"}))
    with pytest.raises(ValueError, match=r"structured_outputs\.json does not compile"):
        grammar.check(check_spec({"json": {"type": "no-such-type"}}))
    p = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)})
    assert SamplingParams.deserialize(p.serialize()) == p  # msgpack-native, round-trips


def test_without_xgrammar_a_constrained_request_fails_by_name(model, monkeypatch):
    def missing():
        raise grammar.MissingGrammarLibrary("structured_outputs needs the grammar library "
                                            "xgrammar, which is not installed")  # fmt: skip

    monkeypatch.setattr(grammar, "xgrammar", missing)
    eng = engine(model)
    rec = eng.add_request(0, [1, 2, 3], sp({"regex": "a+"}, 0))
    assert rec.requests[-1].status == Status.FAILED
    assert "xgrammar" in failure(rec.requests[-1])
    eng.add_request(1, [1, 2, 3], SamplingParams(num_tokens_to_generate=3))
    assert run(eng)[1].status == Status.COMPLETED  # others are served


def test_benchmark_quick_writes_its_json_and_plot(tmp_path):
    from benchmarks.structured_outputs import main

    result = main(quick=True, out_dir=tmp_path)
    assert (tmp_path / "structured_outputs.json").exists()
    assert (tmp_path / "structured_outputs.png").exists()
    assert result["json_schema"]["tokens"] == result["unconstrained"]["tokens"] > 0
    assert result["json_schema"]["mask_cpu_s"] >= 0 and result["unconstrained"]["mask_cpu_s"] >= 0
