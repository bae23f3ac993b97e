"""vLLM's root routes: /tokenize, /detokenize, /tokenizer_info (what lm-eval probes) and the
token-in/token-out /inference/v1/generate (what verifiers' training client calls), checked
against the native client on the same coordinator."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_http_server import native_run, served  # noqa: F401 (the module's server fixture)

from rollout.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _call(server, method: str, route: str, body: dict | None = None, auth: bool = True):
    headers = server.auth if auth else {}
    return httpx.request(method, f"{server.url}{route}", json=body, headers=headers, timeout=60)


def test_tokenizer_routes(served):  # noqa: F811
    r = _call(served, "POST", "/tokenize", {"prompt": "hé", "add_special_tokens": False})
    assert r.json()["tokens"] == list("hé".encode()) and r.json()["count"] == 3
    with_bos = _call(served, "POST", "/tokenize", {"prompt": "h"}).json()["tokens"]
    assert with_bos == [256, 104]  # vLLM's default adds special tokens
    chat = _call(served, "POST", "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert bytes(chat.json()["tokens"]).decode().endswith("<|im_start|>assistant\n")
    assert _call(served, "POST", "/detokenize", {"tokens": [104, 105]}).json() == {"prompt": "hi"}
    info = _call(served, "GET", "/tokenizer_info").json()
    assert info["eos_token"] == "<eos>" and info["bos_token"] == "<bos>"
    assert "im_start" in info["chat_template"]
    assert _call(served, "GET", "/tokenizer_info", auth=False).status_code == 401
    assert _call(served, "POST", "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert _call(served, "POST", "/tokenize", {"prompt": "x", "bogus": 1}).status_code == 400


def test_generate_returns_ids_log_probs_and_weight_versions(served):  # noqa: F811
    prompt = [256, *b"gen"]
    body = {"model": "tiny", "token_ids": prompt, "sampling_params": {
        "max_tokens": 6, "temperature": 0.8, "top_k": -1, "seed": 4, "n": 2, "logprobs": 1,
        "skip_special_tokens": False, "stop_token_ids": []}}  # fmt: skip
    r = _call(served, "POST", "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["prompt_token_ids"] == prompt and len(data["choices"]) == 2
    for i, c in enumerate(data["choices"]):
        sp = SamplingParams(temperature=0.8, seed=4 + i, num_tokens_to_generate=6,
                            return_log_probs=True)  # fmt: skip
        rec = asyncio.run(native_run(served, prompt, sp))
        assert c["token_ids"] == rec.generated_tokens and c["weight_versions"] == [0] * 6
        content = c["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in rec.generated_tokens]
        # n=2 rows batched vs each alone: the same floats (the server is batch-invariant)
        assert [e["logprob"] for e in content] == rec.generated_log_probs
        assert c["finish_reason"] == "length"


@pytest.mark.parametrize(
    "params, param",
    [({"repetition_penalty": 0}, "repetition_penalty"), ({"best_of": 2}, "best_of"),
     ({"temperature": -1}, "temperature"), ({"n": 0}, "n")],
)  # fmt: skip
def test_generate_refuses_what_it_cannot_honour(served, params, param):  # noqa: F811
    body = {"token_ids": [256, 1], "sampling_params": params}
    r = _call(served, "POST", "/inference/v1/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
