"""The OpenAI-compatible HTTP front end, driven through a real `rollout serve --http-port 0`
process with the official `openai` package (one server for the module).

Seeded requests must return the same tokens and log-probs as the native InferenceClient asking
the same coordinator, bit for bit: the server runs batch-invariant (`--batch-invariant`), since
the two sides may run in other batches (n > 1 rows together, the native ones alone) and default
mode's floats differ by batch shape; lifecycle (503 when not waiting, disconnect aborts) is observed through
the coordinator's own stats.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from proc_io import read_until
from prometheus_client.parser import text_string_to_metric_families

from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient
from rollout.serving.http.chat import render_chat

pytestmark = pytest.mark.timeout(120)

CHATML = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HTTP_TOKEN = "http-secret"
COORD_TOKEN = "coord-secret"


class Served:
    def __init__(self, proc: subprocess.Popen, url: str, coordinator: str) -> None:
        self.proc, self.url, self.coordinator = proc, url, coordinator
        self.base = f"{url}/v1"
        self.auth = {"Authorization": f"Bearer {HTTP_TOKEN}"}

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=HTTP_TOKEN, max_retries=0)

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base, api_key=HTTP_TOKEN, max_retries=0)

    async def native(self) -> InferenceClient:
        return await InferenceClient(self.coordinator, auth_token=COORD_TOKEN).start()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    tmp = tmp_path_factory.mktemp("http")
    (tmp / "coord").write_text(COORD_TOKEN)
    (tmp / "http").write_text(HTTP_TOKEN + "\n")
    (tmp / "chat.jinja").write_text(CHATML)
    cmd = [sys.executable, "-m", "rollout.cli", "serve", "--model", "tiny", "--dp", "1",
           "--auth-token-file", str(tmp / "coord"), "--http-port", "0",
           "--http-auth-token-file", str(tmp / "http"), "--chat-template", str(tmp / "chat.jinja"),
           "--batch-invariant"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ROLLOUT_HTTP_TOKEN", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    try:
        coordinator = read_until(proc, r"coordinator (tcp://\S+) pid")[1]
        url = read_until(proc, r"^http (http://\S+)")[1]
        yield Served(proc, url, coordinator)
        proc.terminate()
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def ext(choice) -> dict:
    """The extension fields of an openai response choice."""
    return {k: getattr(choice, k, None)
            for k in ("token_ids", "token_logprobs", "weight_versions", "prompt_token_ids")}  # fmt: skip


async def native_run(served: Served, prompt: list[int], sp: SamplingParams):
    client = await served.native()
    try:
        return (await client.add_request(prompt, sp)).merge()
    finally:
        client.stop()


def test_seeded_completions_equal_the_native_client(served):
    oai = served.openai()
    r = oai.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0.9,
                               top_p=0.95, seed=11, logprobs=2)  # fmt: skip
    c = r.choices[0]
    e = ext(c)
    assert e["prompt_token_ids"] == [256, *b"hello"]  # the byte tokenizer's BOS, then bytes
    assert len(e["token_ids"]) == 8 and e["weight_versions"] == [0] * 8
    assert c.logprobs.token_logprobs == e["token_logprobs"] and len(c.logprobs.top_logprobs) == 8
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 8
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=11, num_tokens_to_generate=8,
                        return_log_probs=True, top_n_logprobs=2)  # fmt: skip
    rec = asyncio.run(native_run(served, e["prompt_token_ids"], sp))
    assert e["token_ids"] == rec.generated_tokens
    assert e["token_logprobs"] == rec.generated_log_probs  # the same floats (batch-invariant)
    assert c.text == rec.generated_text

    # token ids in, token ids out; echo prepends the prompt's text
    r2 = oai.completions.create(model="tiny", prompt=e["prompt_token_ids"], max_tokens=8,
                                temperature=0.9, top_p=0.95, seed=11, echo=True)  # fmt: skip
    assert ext(r2.choices[0])["token_ids"] == rec.generated_tokens
    assert r2.choices[0].text == "hello" + rec.generated_text  # decoding skips the BOS


def test_async_streaming_and_n_match_the_non_streamed_request(served):
    async def go():
        oai = served.async_openai()
        kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=20, seed=3, n=2)
        whole = await oai.completions.create(**kw)
        stream = await oai.completions.create(**kw, stream=True,
                                              stream_options={"include_usage": True})  # fmt: skip
        tokens, lps, reasons, usage = {0: [], 1: []}, {0: [], 1: []}, {}, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                tokens[c.index] += ext(c)["token_ids"]
                lps[c.index] += ext(c)["token_logprobs"]
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
        await oai.close()
        return whole, tokens, lps, reasons, usage

    whole, tokens, lps, reasons, usage = asyncio.run(go())
    by_index = {c.index: ext(c) for c in whole.choices}
    assert sorted(by_index) == [0, 1]
    assert by_index[0]["token_ids"] != by_index[1]["token_ids"]  # seeds 3 and 4
    for i in (0, 1):
        assert tokens[i] == by_index[i]["token_ids"]
        assert lps[i] == pytest.approx(by_index[i]["token_logprobs"], rel=1e-6, abs=1e-6)
    assert reasons == {0: "length", 1: "length"} and usage.completion_tokens == 40


def test_chat_uses_the_template_and_streams(served):
    oai = served.openai()
    messages = [{"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=5,
                                    logprobs=True, top_logprobs=1)  # fmt: skip
    c = r.choices[0]
    rendered = render_chat(CHATML, messages)
    assert ext(c)["prompt_token_ids"] == list(rendered.encode())  # the template, no extra BOS
    assert len(ext(c)["token_ids"]) == 6 and c.message.role == "assistant"
    assert [t.logprob for t in c.logprobs.content] == ext(c)["token_logprobs"]
    chunks = list(oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                              seed=5, stream=True))  # fmt: skip
    streamed = [t for ch in chunks for c in ch.choices for t in (ext(c)["token_ids"] or [])]
    assert streamed == ext(c)["token_ids"]
    text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert text == r.choices[0].message.content
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=2, tools=tools)
    with_tools = render_chat(CHATML, messages, tools=tools)
    assert "<tools>" in with_tools
    assert ext(r.choices[0])["prompt_token_ids"] == list(with_tools.encode())


def test_models_health_and_metrics(served):
    assert [m.id for m in served.openai().models.list()] == ["tiny"]
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}  # open without a token
    assert httpx.get(f"{served.url}/metrics").status_code == 401
    text = httpx.get(f"{served.url}/metrics", headers=served.auth).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip
    assert samples[("rollout_coordinator_state", (("state", "RUNNING"),))] == 1
    assert samples[("rollout_weight_version", ())] == 0
    assert samples[("rollout_engines", ())] == 1
    assert ("rollout_http_request_latency_seconds_count", (("route", "/v1/models"),)) in samples


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served):
    oai = served.openai()
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", temperature=-1)
    assert e.value.status_code == 400
    err = e.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "temperature"
    assert "temperature must be >= 0" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert e.value.response.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other", prompt="x")
    r = httpx.post(f"{served.base}/completions", headers=served.auth, content=b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{served.base}/completions", headers=served.auth, json={"max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "Traceback" not in r.text
    r = httpx.post(
        f"{served.base}/completions",
        headers=served.auth,
        json={"prompt": [100000], "max_tokens": 2},
    )  # the engine refuses the id
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    r = httpx.get(f"{served.base}/nope", headers=served.auth)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    still = oai.completions.create(
        model="tiny", prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
    )  # random weights may stop early
    assert len(ext(still.choices[0])["token_ids"]) == 2  # fmt: skip


def test_bearer_auth(served):
    bad = openai.OpenAI(base_url=served.base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    r = httpx.post(f"{served.base}/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.base}/models").status_code == 401


def test_paused_requests_wait_or_get_503_and_disconnects_abort(served):
    async def go():
        native = await served.native()
        http = httpx.AsyncClient(base_url=served.base, headers=served.auth, timeout=30)
        # sampled (no seed): ignore_eos, or an early EOS leaves fewer than 4 tokens
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}

        async def stats():
            return await native.stats()

        try:
            await native.pause_engines()
            r = await http.post("/completions", json=body, headers={"X-Rollout-No-Wait": "1"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engines_not_running"
            r = await http.post("/completions", json={**body, "wait": False})
            assert r.status_code == 503

            # a waiting request completes once the engines resume
            waiting = asyncio.create_task(http.post("/completions", json=body))
            s = {}

            async def pending(n):
                s.update(await stats())
                return s["pending_requests"] == n

            await _until(lambda: pending(1))
            await native.unpause_engines()
            r = await waiting
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4

            # callers that go away while held abort their requests (plain and streamed)
            await native.pause_engines()
            aborts = (await stats())["counters"].get("aborts", 0)
            for k, stream in enumerate((False, True), start=1):
                task = asyncio.create_task(http.post("/completions",
                                                     json={**body, "stream": stream}))  # fmt: skip
                await _until(lambda k=k: pending(k))
                task.cancel()  # closes the connection

                async def aborted(k=k):
                    return (await stats())["counters"].get("aborts", 0) == aborts + k

                await asyncio.gather(task, return_exceptions=True)
                await _until(aborted)
            await native.unpause_engines()
            await _until(lambda: pending(0))  # the paused engine finishes them once it runs
        finally:
            await native.unpause_engines()
            await http.aclose()
            native.stop()

    asyncio.run(go())


async def _until(check, timeout: float = 10.0) -> None:
    """Await an async predicate (one coordinator stats round trip per check) until it holds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_weight_update_through_the_manager_lands_where_the_versions_say():
    """HTTP in front of a RolloutManager's coordinator (dp=2): an update pushed while a request
    streams shows in its per-token versions as one switch from 0 to 1, after the tokens already
    streamed, and a request sent afterwards is all version 1."""
    import socket

    import uvicorn

    from rollout import InferenceConfig
    from rollout.models import ModelConfig, build_model
    from rollout.rl.manager import RolloutManager
    from rollout.rl.manager_config import RolloutManagerConfig
    from rollout.serving.http.app import build_app
    from rollout.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    model = build_model(ModelConfig.preset("tiny", vocab_size=tok.vocab_size), seed=0)
    manager = RolloutManager(RolloutManagerConfig(dp=2), model=model, tokenizer=tok,
                             inference_config=InferenceConfig(streaming_interval=4))  # fmt: skip
    cluster = manager.engine.cluster
    app = build_app(cluster.address, auth_token=cluster.auth_token, tokenizer=tok,
                    model_name="tiny")  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    new = {k: v + 0.02 for k, v in model.state_dict().items()}

    async def go():
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        oai = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
        try:
            stream = await oai.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=300,
                                                  stream=True,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
            versions, updated = [], None
            async for chunk in stream:
                for c in chunk.choices:
                    versions += ext(c)["weight_versions"]
                if updated is None and versions:
                    seen = len(versions)
                    updated = asyncio.create_task(asyncio.to_thread(manager.update_weights, new, 1))
            assert await updated == 1
            after = await oai.completions.create(
                model="tiny", prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True}
            )
            return versions, seen, ext(after.choices[0])["weight_versions"]
        finally:
            await oai.close()
            server.should_exit = True
            await serving

    try:
        versions, seen, after = asyncio.run(go())
    finally:
        manager.close()
        sock.close()
    switch = versions.index(1) if 1 in versions else len(versions)
    assert len(versions) == 300 and switch >= seen, (switch, seen)
    assert versions == [0] * switch + [1] * (300 - switch) and switch < 300
    assert after == [1] * 4


# -- in process: the mapping and the error paths no server run reaches ----------------------------


def test_sampling_params_mapping_and_refusals():
    from rollout.serving.http.schemas import APIError, ChatRequest, CompletionRequest
    from rollout.serving.http.schemas import sampling_params as to_sp

    sps = to_sp(CompletionRequest(prompt="x", max_tokens=5, n=3, seed=9, stop="\n", logprobs=2))
    assert [sp.seed for sp in sps] == [9, 10, 11]
    assert sps[0].num_tokens_to_generate == 5 and sps[0].stop_words == ["\n"]
    assert sps[0].return_log_probs and sps[0].top_n_logprobs == 2
    chat = to_sp(ChatRequest(messages=[{"role": "user", "content": "x"}],
                             max_completion_tokens=7, logprobs=True, top_logprobs=3))  # fmt: skip
    assert chat[0].num_tokens_to_generate == 7 and chat[0].top_n_logprobs == 3
    for bad, param in [({"top_p": 0}, "top_p"), ({"presence_penalty": 3}, "presence_penalty"),
                       ({"n": 0}, "n"), ({"logprobs": 5000}, "logprobs")]:  # fmt: skip
        with pytest.raises(APIError) as e:
            to_sp(CompletionRequest(prompt="x", **bad))
        assert e.value.status == 400 and e.value.param == param, e.value.body()


def test_unexpected_exceptions_answer_500_json_and_the_app_keeps_serving():
    from rollout.serving.http.app import build_app
    from rollout.tokenizers import ByteTokenizer

    class Broken:
        def add_request(self, *args, **kw):
            raise RuntimeError("boom in the client")

    app = build_app("tcp://127.0.0.1:9", tokenizer=ByteTokenizer(), model_name="m")
    app.state.backend.client = Broken()  # no lifespan here: the client never starts

    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "Traceback" not in r.text
            assert (await c.get("/health")).status_code == 200

    asyncio.run(go())
