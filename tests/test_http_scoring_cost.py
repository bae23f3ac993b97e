"""Scoring requests priced on what they produce, and scored once (issue 31, defect 5): `echo` +
`logprobs: k` + `max_tokens: 0` answers every prompt position with 1 + k entries in each of n
choices, and the engines computed the prompt's log-probs once per choice."""

from __future__ import annotations

import asyncio

import pytest
from http_inproc import asgi_client, scripted_app

from rollout.sampling import SamplingParams
from rollout.serving.http.limits import Admission, Limits
from rollout.serving.http.schemas import APIError

PROMPT = list(range(1, 51))  # 50 positions, 49 with a log-prob


def _scored(limits: Limits, body: dict):
    app, client = scripted_app(lambda p, sp: [9, 9, 9], limits=limits)

    async def go():
        async with asgi_client(app) as http:
            return await http.post("/v1/completions", json=body)

    return asyncio.run(go()), client


def test_a_prompt_is_scored_once_for_its_n_choices():
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0, "n": 8}
    r, client = _scored(Limits(), body)
    assert r.status_code == 200, r.text
    scored = [len(p) - 1 for p, sp in client.submitted if sp.return_prompt_log_probs]
    assert scored == [49] and len(client.submitted) == 1  # was 8 x 49 positions, 8 requests
    choices = r.json()["choices"]
    assert len(choices) == 8 and all(c == {**choices[0], "index": i} for i, c in enumerate(choices))
    assert len(choices[0]["logprobs"]["token_logprobs"]) == 50 and choices[0]["token_ids"] == []

    r, client = _scored(Limits(), {**body, "max_tokens": 3})  # echo with generation
    scored = [len(p) - 1 for p, sp in client.submitted if sp.return_prompt_log_probs]
    assert scored == [49] and len(client.submitted) == 8
    lps = [c["logprobs"]["token_logprobs"] for c in r.json()["choices"]]
    assert all(len(x) == 53 and x[:50] == lps[0][:50] for x in lps), r.text


def test_echoed_log_probs_are_priced_per_request():
    # 8 choices x 50 positions x (1 + 20) + 8 = 8,408 tokens; unpriced it was 408
    body = {"prompt": PROMPT, "echo": True, "logprobs": 20, "max_tokens": 0, "n": 8}
    limits = Limits(max_request_tokens=8000, max_inflight_tokens=8000)
    r, client = _scored(limits, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert "8408" in r.json()["error"]["message"] and client.submitted == []
    assert _scored(limits, {**body, "logprobs": 18})[0].status_code == 200  # 7,608


def test_echoed_log_probs_are_priced_in_flight():
    limits = Limits(max_request_tokens=5000, max_inflight_tokens=8000)
    admission = Admission(limits)
    sp = SamplingParams(num_tokens_to_generate=1, return_prompt_log_probs=True, top_n_logprobs=9)
    held = admission.admit([PROMPT], [sp] * 8)  # 8 x 50 x 10 + 8 = 4,008
    assert held.tokens == 4008
    with pytest.raises(APIError) as e:
        admission.admit([PROMPT], [sp] * 8)
    assert e.value.status == 429
    held.release()
    admission.admit([PROMPT], [sp] * 8).release()
    assert (admission.choices, admission.tokens) == (0, 0)
