"""Structured outputs over HTTP against a real `rollout serve` (tiny random byte model, hermes
tool-call parser): the official `openai` client's response_format json_schema answers all parse
and validate, vLLM's guided_* extras and structured_outputs on /v1 and /inference/v1/generate
are honoured, tool_choice "required" and a named function come back as parsed calls whose
arguments follow the tool's schema, and bad specs are 400s naming the field."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from http_serve import serve_http

from rollout.engine import grammar
from rollout.sampling import SamplingParams
from rollout.serving.http import structured, tool_choice
from rollout.serving.http.schemas import APIError

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{0,6}$"},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "temp", "sunny"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "shout", "parameters": {
        "type": "object", "properties": {"word": {"enum": ["hi", "yo"]}}, "required": ["word"],
        "additionalProperties": False}}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = serve_http(tmp_path_factory.mktemp("structured"), "--tool-call-parser", "hermes")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.base, api_key="http-secret", max_retries=0)


def _post(served, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}/{route}", json=body, headers=served.auth, timeout=120)


def test_openai_json_schema_answers_parse_and_validate(oai):
    out = oai.chat.completions.create(model="tiny", messages=MESSAGES, n=6, seed=11,
                                      max_tokens=80, response_format=RESPONSE_FORMAT)  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    free = oai.chat.completions.create(model="tiny", messages=MESSAGES, n=6, seed=11,
                                       max_tokens=80)  # fmt: skip
    for choice in free.choices:  # the model alone writes no JSON
        with pytest.raises(ValueError):
            json.loads(choice.message.content)


def test_json_schema_streamed(oai):
    text = ""
    for chunk in oai.chat.completions.create(model="tiny", messages=MESSAGES, seed=3,
                                             max_tokens=80, response_format=RESPONSE_FORMAT,
                                             stream=True):  # fmt: skip
        text += "".join(c.delta.content or "" for c in chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": "[0-9]{2}-[a-c]{3}"}, lambda s: re.fullmatch("[0-9]{2}-[a-c]{3}", s)),
        ({"guided_choice": ["red", "green"]}, lambda s: s in ("red", "green")),
        ({"guided_json": SCHEMA}, lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None),
        ({"guided_grammar": 'root ::= "a" [xy]+ "b"'}, lambda s: re.fullmatch("a[xy]+b", s)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda s: s in ("up", "down")),
        ({"response_format": {"type": "json_object"}}, lambda s: isinstance(json.loads(s), dict)),
    ],
)
def test_vllm_extras_on_completions(oai, extra, check):
    out = oai.completions.create(model="tiny", prompt="Answer: ", n=3, seed=5, max_tokens=60,
                                 extra_body=extra)  # fmt: skip
    for choice in out.choices:
        if choice.finish_reason == "length" and "response_format" in extra:
            continue  # any JSON object is unbounded; a bounded one is checked above
        assert check(choice.text), choice.text


def test_generate_route_structured_outputs(served):
    body = {"model": "tiny", "token_ids": [72, 105],
            "sampling_params": {"max_tokens": 20, "n": 3, "seed": 1,
                                "structured_outputs": {"choice": ["cat", "dog"]}}}  # fmt: skip
    r = _post(served, "inference/v1/generate", body)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        ids = [t for t in c["token_ids"] if t < 256]
        assert bytes(ids).decode() in ("cat", "dog")
    old = {**body, "sampling_params": {"max_tokens": 20, "guided_decoding": {"regex": "z+"}}}
    (c,) = _post(served, "inference/v1/generate", old).json()["choices"]
    assert set(bytes(t for t in c["token_ids"] if t < 256).decode()) == {"z"}


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def test_tool_choice_required_is_a_parsed_call_following_the_schema(oai):
    validators = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    single = oai.chat.completions.create(
        n=4, seed=0, parallel_tool_calls=False, max_tokens=120, **kw
    )
    several = oai.chat.completions.create(seed=1, max_tokens=400, **kw)  # as many as it likes
    assert len(several.choices[0].message.tool_calls) > 1
    for choice in [*single.choices, *several.choices]:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(_args(call), validators[call.function.name])
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


def test_tool_choice_named_and_streamed(oai):
    named = {"type": "function", "function": {"name": "shout"}}
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=80)
    # each call its own cache salt: both prefill the prompt cold, one computation run twice (a
    # prefix hit prefills another shape, and default mode's floats, so a seeded draw, may differ)
    answer = oai.chat.completions.create(seed=4, extra_body={"cache_salt": "whole"}, **kw)
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "shout" and _args(call)["word"] in ("hi", "yo")
    calls, reason = {}, None
    for chunk in oai.chat.completions.create(seed=4, stream=True,
                                             extra_body={"cache_salt": "streamed"}, **kw):  # fmt: skip
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                acc = calls.setdefault(d.index, {"name": "", "arguments": ""})
                acc["name"] += (d.function and d.function.name) or ""
                acc["arguments"] += (d.function and d.function.arguments) or ""
            reason = c.finish_reason or reason
    assert reason == "tool_calls"
    assert calls == {0: {"name": "shout", "arguments": call.function.arguments}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
    ],
)  # fmt: skip
def test_bad_specs_are_400_naming_the_field(served, extra, param):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    r = _post(served, "v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_generate_route_bad_spec_is_400(served):
    body = {"model": "tiny", "token_ids": [1],
            "sampling_params": {"structured_outputs": {"regex": "("}}}  # fmt: skip
    r = _post(served, "inference/v1/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


def test_without_xgrammar_a_structured_request_is_refused_by_name(monkeypatch):
    def missing():
        raise grammar.MissingGrammarLibrary("structured_outputs needs the grammar library "
                                            "xgrammar, which is not installed")  # fmt: skip

    monkeypatch.setattr(grammar, "xgrammar", missing)
    with pytest.raises(APIError) as e:
        structured.constrain([SamplingParams()], [("response_format", {"json_object": True})])
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "xgrammar" in e.value.message


def test_forced_tool_call_needs_a_parser():
    class Backend:
        tool_call_parser = None
        enable_auto_tool_choice = False

    class Req:
        tools = TOOLS
        tool_choice = "required"

    with pytest.raises(APIError) as e:
        tool_choice.parser_for(Backend(), Req())
    assert e.value.param == "tool_choice" and "--tool-call-parser" in e.value.message
