"""Scoring over /v1/completions as lm-eval's `local-completions` does it: `echo` with `logprobs`
returns every prompt token's log-prob (the first None), `max_tokens: 0` scores without
generating, and `text_offset` points into the returned text. Checked against the native
client's exact prompt log-probs on the same coordinator."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_http_server import native_run, served  # noqa: F401 (the module's server fixture)

from rollout.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}/completions", json={"model": "tiny", **body},
                      headers=server.auth, timeout=60)  # fmt: skip


def test_echo_returns_the_prompt_log_probs_the_engine_computes(served):  # noqa: F811
    prompt = [256, *b"score me"]
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 2, "echo": True, "temperature": 0}
    c = _post(served, body).json()["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and c["text"].startswith("score me")
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    sp = SamplingParams(temperature=0, num_tokens_to_generate=1, return_log_probs=True,
                        return_prompt_log_probs=True, top_n_logprobs=2)  # fmt: skip
    rec = asyncio.run(native_run(served, prompt, sp))
    assert lp["token_logprobs"][1:-1] == pytest.approx(rec.prompt_log_probs, abs=1e-5)
    for i, top in enumerate(lp["top_logprobs"][1:-1]):
        assert 2 <= len(top) <= 3  # the top 2 and the prompt token itself
        assert top[lp["tokens"][i + 1]] == pytest.approx(rec.prompt_log_probs[i], abs=1e-5)
        assert max(top.values()) >= lp["token_logprobs"][i + 1]
    # offsets into the returned text: the BOS has no text, then one byte (char) per token
    assert lp["text_offset"][:10] == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    text = c["text"]
    assert [text[o : o + 1] for o in lp["text_offset"][2:9]] == list("core me")


def test_max_tokens_0_scores_without_generating(served):  # noqa: F811
    prompt = [256, *b"abc"]
    r = _post(served, {"prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": True}).json()
    c = r["choices"][0]
    assert c["text"] == "abc" and c["token_ids"] == [] and c["finish_reason"] == "length"
    assert len(c["logprobs"]["token_logprobs"]) == 4 and c["logprobs"]["token_logprobs"][0] is None
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 4
    with_gen = _post(served, {"prompt": prompt, "max_tokens": 1, "logprobs": 0, "echo": True})
    lps = with_gen.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[:4] == pytest.approx(c["logprobs"]["token_logprobs"][:4], abs=1e-5)


def test_text_offsets_count_characters_not_bytes(served):  # noqa: F811
    prompt = [256, *"é€x".encode()]  # 2 + 3 + 1 byte tokens
    c = _post(served, {"prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": True}).json()
    # a token inside a character begins where the character does
    assert c["choices"][0]["logprobs"]["text_offset"] == [0, 0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ({"echo": True, "stream": True}, "echo"),
    ],
)
def test_scoring_requests_that_cannot_be_served_are_refused(served, body, param):  # noqa: F811
    r = _post(served, {"prompt": [256, 97], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
