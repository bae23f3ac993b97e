"""vLLM's sampling surface over HTTP, on a real `rollout serve`: the logits parameters mean the
same on /v1/completions, /v1/chat/completions and /inference/v1/generate; vLLM's no-op values
are accepted everywhere; skyrl-train's remote-engine body works as it sends it; streaming usage
(continuous_usage_stats) and the first token going out at once; the small conformance gaps
(chat max_tokens 0, stream_options without stream, GET /v1/models/{id}, /metrics labels)."""

from __future__ import annotations

import json

import httpx
import pytest
from http_serve import serve_http
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(180)

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
NOOPS = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
         "frequency_penalty": 0.0, "min_tokens": 0, "skip_special_tokens": True,
         "spaces_between_special_tokens": True}  # fmt: skip
LOGITS = {"repetition_penalty": 1.6, "frequency_penalty": 0.5, "logit_bias": {"101": 4.0},
          "min_tokens": 6, "bad_words": ["o"]}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = serve_http(tmp_path_factory.mktemp("sampling"))
    yield s
    assert "Traceback" not in s.stop()


def post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{s.url}{path}", json=body, headers=s.auth, timeout=120)


def tokens_on(s, route: str, params: dict, n: int = 10) -> list[int]:
    """The generated ids of a greedy request on `route` with `params` (vLLM's names)."""
    base = {"temperature": 0.0, "max_tokens": n, "ignore_eos": True, **params}
    if route == "generate":
        r = post(s, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": base})
    elif route == "chat":
        r = post(s, "/v1/chat/completions", {"model": "tiny", "prompt_token_ids": PROMPT,
                                             "messages": [{"role": "user", "content": "-"}],
                                             **base})  # fmt: skip
    else:
        r = post(s, "/v1/completions", {"model": "tiny", "prompt": PROMPT, **base})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


ROUTES = ["completions", "chat", "generate"]


def test_no_op_values_and_logits_parameters_mean_the_same_on_every_route(server):
    plain = {route: tokens_on(server, route, {}) for route in ROUTES}
    assert len({tuple(t) for t in plain.values()}) == 1
    for route in ROUTES:
        assert tokens_on(server, route, NOOPS) == plain[route]
    shaped = {route: tokens_on(server, route, LOGITS) for route in ROUTES}
    assert len({tuple(t) for t in shaped.values()}) == 1
    assert shaped["chat"] != plain["chat"] and ord("o") not in shaped["chat"]
    allowed = tokens_on(server, "completions", {"allowed_token_ids": [120, 121]})
    assert set(allowed) <= {120, 121}
    assert tokens_on(server, "generate", {"allowed_token_ids": [120, 121]}) == allowed


def test_masked_tokens_are_not_among_the_top_log_probs(server):
    """processed log-probs of masked tokens are -inf: they are left out of the top-n (JSON has
    no -inf), so a top-5 over two allowed tokens holds two."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "logprobs": 5,
            "logprobs_mode": "processed_logprobs", "allowed_token_ids": [120, 121]}  # fmt: skip
    for stream in (False, True):
        if stream:
            chunks = _chunks(server, "/v1/completions", {**body, "stream": True})
            tops = [t for c in chunks for t in c["choices"][0]["logprobs"]["top_logprobs"]]
        else:
            r = post(server, "/v1/completions", body)
            assert r.status_code == 200, r.text
            tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert len(tops) == 4 and all(1 <= len(t) <= 2 for t in tops)


def test_skyrl_train_remote_engine_body(server):
    """skyrl-train's RemoteInferenceEngine (vllm backend) POSTs its sampling params, as
    `get_vllm_sampling_params` builds them from its default config, with `model` and a batch of
    token-id prompts, to /v1/completions; it reads each choice's text and finish_reason in
    index order."""
    body = {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
            "max_tokens": 12, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "logprobs": None, "stop": None, "repetition_penalty": 1.0, "additional_kwargs": None,
            "model": "tiny", "prompt": [PROMPT, PROMPT[:5]]}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body,
                   headers={"Content-Type": "application/json", **server.auth}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        assert isinstance(c["text"], str) and c["finish_reason"] in ("stop", "length")
        assert len(c["token_ids"]) >= 1


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
        (
            "/v1/completions",
            {"spaces_between_special_tokens": False},
            "spaces_between_special_tokens",
        ),
        ("/v1/completions", {"min_tokens": 9}, "min_tokens"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"min_p": 1.5}, "min_p"),
        ("/v1/completions", {"logit_bias": {"x": 1.0}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"top_k": -2}, "top_k"),
    ],
)
def test_refused_with_the_parameter_named(server, path, extra, param):
    body = {"model": "tiny", "max_tokens": 4, **extra}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "params, param",
    [
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"logit_bias": {"7": -200}}, "logit_bias"),
    ],
)
def test_generate_route_refuses_by_name(server, params, param):
    r = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": params})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_out_of_vocab_ids_are_a_400(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                         "allowed_token_ids": [5, 99_999]})  # fmt: skip
    assert r.status_code == 400 and "allowed_token_ids" in r.json()["error"]["message"], r.text


def _chunks(s, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{s.url}{path}", json=body, headers=s.auth, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_on_every_chunk_and_the_first_token_at_once(server, chat):
    """Usage on every chunk (the choice's counts so far); with the server's streaming interval
    of 8, the first chunk that carries tokens carries exactly the first one."""
    body = {"model": "tiny", "max_tokens": 20, "temperature": 0.0, "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT}
    chunks = _chunks(server, path, body)
    assert all("usage" in c for c in chunks)
    seen = 0
    for c in chunks[:-1]:
        seen += len(c["choices"][0].get("token_ids", []))
        assert c["usage"]["completion_tokens"] == seen
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + seen
    assert seen == 20 and chunks[-1]["usage"]["completion_tokens"] == 20
    with_tokens = [c for c in chunks[:-1] if c["choices"][0].get("token_ids")]
    assert len(with_tokens[0]["choices"][0]["token_ids"]) == 1


def test_get_model_by_id(server):
    listed = httpx.get(f"{server.base}/models", headers=server.auth).json()["data"][0]
    r = httpx.get(f"{server.base}/models/{listed['id']}", headers=server.auth)
    assert r.status_code == 200 and r.json() == listed
    r = httpx.get(f"{server.base}/models/other/model", headers=server.auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_metrics_label_the_included_routes_by_template(server):
    post(server, "/tokenize", {"prompt": "hi"})
    post(server, "/detokenize", {"tokens": [104, 105]})
    httpx.get(f"{server.url}/tokenizer_info", headers=server.auth)
    post(
        server,
        "/inference/v1/generate",
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}},
    )
    text = httpx.get(f"{server.url}/metrics", headers=server.auth).text
    routes = {
        s.labels["route"]
        for fam in text_string_to_metric_families(text)
        if fam.name == "rollout_http_requests"
        for s in fam.samples
    }
    assert {"/tokenize", "/detokenize", "/tokenizer_info", "/inference/v1/generate"} <= routes
