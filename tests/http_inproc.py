"""The HTTP app in this process, on a scripted stand-in for the coordinator client: each request
is answered at once with the tokens `reply(prompt, sampling_params)` gives (streamed in
`chunk`-token partials), and every submission is kept, so tests can count what the app asks of
the engines (how many requests, which asked for prompt log-probs) without running any."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import httpx

from rollout.events import Status
from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams
from rollout.serving.client import Partial

Reply = Callable[[list[int], SamplingParams], list[int]]


class ScriptedClient:
    """Stands in for InferenceClient: answers from `reply`, records `submitted`."""

    def __init__(self, reply: Reply, chunk: int = 8) -> None:
        self.reply, self.chunk = reply, chunk
        self.submitted: list[tuple[list[int], SamplingParams]] = []
        self._ids = itertools.count()

    def record(self, prompt: list[int], sp: SamplingParams) -> DynamicInferenceRequestRecord:
        self.submitted.append((list(prompt), sp))
        tokens = list(self.reply(list(prompt), sp))[: sp.num_tokens_to_generate]
        top = [{k: -2.0 - k for k in range(sp.top_n_logprobs)}]
        prompt_lps = [-0.5] * (len(prompt) - 1) if sp.return_prompt_log_probs else None
        req = DynamicInferenceRequest(
            request_id=next(self._ids), prompt_tokens=list(prompt), sampling_params=sp,
            status=Status.COMPLETED, stop_reason="length", generated_tokens=tokens,
            generated_log_probs=[-1.0] * len(tokens), generated_weight_versions=[0] * len(tokens),
            generated_top_n_logprobs=top * len(tokens) if sp.top_n_logprobs else [],
            prompt_log_probs=prompt_lps,
            prompt_top_n_logprobs=top * len(prompt_lps) if prompt_lps and sp.top_n_logprobs
            else None,
        )  # fmt: skip
        return DynamicInferenceRequestRecord.from_request(req)

    def add_request(
        self, prompt: list[int], sp: SamplingParams, routing_key: str | None = None
    ) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.record(prompt, sp))
        return fut

    async def stream(self, prompt: list[int], sp: SamplingParams):
        rec = self.record(prompt, sp)
        tokens = rec.requests[0].generated_tokens
        for i in range(0, len(tokens), self.chunk):
            part = tokens[i : i + self.chunk]
            yield Partial(part, [-1.0] * len(part), weight_versions=[0] * len(part))
            await asyncio.sleep(0)
        yield rec

    def abort(self, fut: Any) -> None:
        pass

    async def stats(self) -> dict:
        return {"state": "RUNNING", "pending_requests": 0}


def scripted_app(reply: Reply, tokenizer: Any = None, chunk: int = 8, **kw: Any):
    """(the app, its ScriptedClient); `kw`: build_app's."""
    from rollout.serving.http.app import build_app
    from rollout.tokenizers import ByteTokenizer

    app = build_app("tcp://127.0.0.1:9", tokenizer=tokenizer or ByteTokenizer(),
                    model_name="m", **kw)  # fmt: skip
    client = ScriptedClient(reply, chunk)
    app.state.backend.client = client
    return app, client


def asgi_client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60)
