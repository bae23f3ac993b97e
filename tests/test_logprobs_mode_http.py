"""logprobs_mode over HTTP: `rollout serve --logprobs-mode` (vLLM's flag and values) sets the
default, the request's `logprobs_mode` extension field overrides it, anything else is a 400
naming the field. Checked against the native client asking the same coordinator."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import openai
import pytest
from proc_io import read_until

from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient
from rollout.serving.http.schemas import APIError, ChatRequest, CompletionRequest
from rollout.serving.http.schemas import sampling_params as to_sp

pytestmark = pytest.mark.timeout(120)
TOKEN = "coord-secret"


def test_request_field_overrides_the_server_default():
    assert to_sp(CompletionRequest(prompt="x"))[0].logprobs_mode == "raw"
    assert to_sp(CompletionRequest(prompt="x"), "processed_logprobs")[0].logprobs_mode == "processed"  # fmt: skip
    req = CompletionRequest(prompt="x", logprobs_mode="raw_logprobs")
    assert to_sp(req, "processed_logprobs")[0].logprobs_mode == "raw"
    chat = ChatRequest(messages=[{"role": "user", "content": "x"}], logprobs_mode="processed_logprobs")  # fmt: skip
    assert to_sp(chat)[0].logprobs_mode == "processed"
    for bad in ("processed", "raw_logits", "processed_logits"):
        with pytest.raises(APIError) as e:
            to_sp(CompletionRequest(prompt="x", logprobs_mode=bad))
        assert e.value.status == 400 and e.value.param == "logprobs_mode", e.value.body()
        assert bad in e.value.message


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lp_http")
    (tmp / "coord").write_text(TOKEN)
    cmd = [sys.executable, "-m", "rollout.cli", "serve", "--model", "tiny",
           "--auth-token-file", str(tmp / "coord"), "--http-port", "0",
           "--logprobs-mode", "processed_logprobs"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ROLLOUT_HTTP_TOKEN", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    try:
        coordinator = read_until(proc, r"coordinator (tcp://\S+) pid")[1]
        url = read_until(proc, r"^http (http://\S+)")[1]
        yield url, coordinator
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def _native(coordinator: str, prompt: list[int], sp: SamplingParams):
    client = await InferenceClient(coordinator, auth_token=TOKEN).start()
    try:
        return (await client.add_request(prompt, sp)).merge()
    finally:
        client.stop()


def test_served_log_probs_follow_the_flag_and_the_field(served):
    url, coordinator = served
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny", prompt="hello", max_tokens=6, temperature=0.7, seed=5)
    got = {}
    for mode in (None, "raw_logprobs"):
        extra = {} if mode is None else {"logprobs_mode": mode}
        c = oai.completions.create(**kw, extra_body=extra).choices[0]
        got[mode or "processed_logprobs"] = (c.prompt_token_ids, c.token_ids, c.token_logprobs)
    for mode, (prompt, tokens, lps) in got.items():
        sp = SamplingParams(temperature=0.7, seed=5, num_tokens_to_generate=6,
                            return_log_probs=True, logprobs_mode=mode.split("_")[0])  # fmt: skip
        rec = asyncio.run(_native(coordinator, prompt, sp))
        assert tokens == rec.generated_tokens
        assert lps == pytest.approx(rec.generated_log_probs, rel=1e-6, abs=1e-6)
    # same tokens (same seed), different distributions
    assert got["raw_logprobs"][1] == got["processed_logprobs"][1]
    assert got["raw_logprobs"][2] != pytest.approx(got["processed_logprobs"][2], abs=1e-3)
    with pytest.raises(openai.BadRequestError, match="logprobs_mode"):
        oai.completions.create(**kw, extra_body={"logprobs_mode": "raw_logits"})
