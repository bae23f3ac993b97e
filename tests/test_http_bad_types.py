"""Every field's type is checked before anything uses it, on every route (issue 31, defect 8): a
string seed on /inference/v1/generate was a 500 with a logged traceback. A table of bad types,
each a 400 naming its field, with nothing submitted and nothing logged as an internal error."""

from __future__ import annotations

import asyncio
import logging

import pytest
from http_inproc import asgi_client, scripted_app
from http_serve import CHATML

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
GEN = {"token_ids": [1, 2, 3]}

BAD = [
    ("/inference/v1/generate", {**GEN, "sampling_params": {"seed": "7"}}, "seed"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"seed": 1.5}}, "seed"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"n": "2"}}, "n"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"max_tokens": 2.0}}, "max_tokens"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"temperature": "hot"}}, "temperature"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"top_k": True}}, "top_k"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"stop": [1]}}, "stop"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"stop_token_ids": ["a"]}},
     "stop_token_ids"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"logprobs": "5"}}, "logprobs"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"ignore_eos": "no"}}, "ignore_eos"),
    ("/inference/v1/generate", {**GEN, "sampling_params": {"min_p": "0"}}, "min_p"),
    ("/inference/v1/generate", {**GEN, "sampling_params": "greedy"}, "sampling_params"),
    ("/inference/v1/generate", {"token_ids": ["a"]}, "token_ids"),
    ("/v1/completions", {"prompt": "a", "seed": "7"}, "seed"),
    ("/v1/completions", {"prompt": "a", "n": 2.0}, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": "y"}},
     "stream_options"),
    ("/v1/completions", {"prompt": [[1], "a", 2]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "seed": [1]}, "seed"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "9"}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 1.0, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "prompt_token_ids": [1.5]}, "prompt_token_ids"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": 1}]}, "messages"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, "tokens"),
]  # fmt: skip


def test_bad_types_are_400_naming_the_field_on_every_route(caplog):
    app, client = scripted_app(lambda p, sp: [1], chat_template=CHATML)

    async def go():
        async with asgi_client(app) as http:
            return [await http.post(route, json=body) for route, body, _ in BAD]

    with caplog.at_level(logging.ERROR):
        answers = asyncio.run(go())
    got = [(r.status_code, r.json()["error"]["param"]) for r in answers]
    assert got == [(400, param) for _, _, param in BAD], [r.text for r in answers]
    for r, (_, _, param) in zip(answers, BAD, strict=True):
        assert param in r.json()["error"]["message"], r.text
    assert client.submitted == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("seed", ["7", 1.5, [1], {"a": 1}])
def test_generate_seed_of_another_type_is_400_not_500(seed):
    app, client = scripted_app(lambda p, sp: [1, 2])

    async def go():
        async with asgi_client(app) as http:
            bad = await http.post("/inference/v1/generate",
                                  json={**GEN, "sampling_params": {"seed": seed}})  # fmt: skip
            good = await http.post("/inference/v1/generate",
                                   json={**GEN, "sampling_params": {"seed": 7, "n": 2}})  # fmt: skip
            return bad, good

    bad, good = asyncio.run(go())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed", bad.text
    assert good.status_code == 200 and [sp.seed for _, sp in client.submitted] == [7, 8]
