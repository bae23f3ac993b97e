"""`Backend`: what every route of the app shares (app.state.backend): the coordinator client,
tokenizer, chat template, limits, metrics, and the thread that does big text work."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollout.serving.client import InferenceClient
from rollout.serving.client_errors import ClientStopped
from rollout.serving.http.limits import Admission, Limits
from rollout.serving.http.metrics import HTTPMetrics
from rollout.serving.http.schemas import bad_request
from rollout.tokenizers import detokenize_with, tokenize_with


class Backend:
    """What the routes share: the client, tokenizer, chat template and metrics."""

    def __init__(self, address: str, auth_token: str | None, tokenizer: Any, model_name: str,
                 chat_template: str | None, special_tokens: dict[str, str],
                 http_token: str | None, limits: Limits) -> None:  # fmt: skip
        self.client = InferenceClient(address, auth_token=auth_token)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.http_token = http_token
        self.logprobs_mode = "raw_logprobs"  # of requests that name none (--logprobs-mode)
        self.metrics = HTTPMetrics()
        self.limits = limits
        self.admission = Admission(limits)
        self.created = int(time.time())
        # tokenizing, detokenizing and serializing big bodies: off the event loop, so /health
        # and every other caller are answered meanwhile; one thread, as tokenizers need not be
        # safe to share
        self.text_pool = ThreadPoolExecutor(1, thread_name_prefix="http-text")

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` on the text thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.text_pool, functools.partial(fn, *args))

    def text(self, ids: list[int]) -> str:
        return detokenize_with(self.tokenizer, ids) or ""

    def tokenize(self, text: str, bos: bool) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: give token ids as the prompt", "prompt")
        return tokenize_with(self.tokenizer, text, bos=bos)


async def coordinator_stats(be: Backend) -> dict | None:
    """The coordinator's stats, or None when it does not answer within 5 s."""
    try:
        return await asyncio.wait_for(be.client.stats(), 5.0)
    except (asyncio.TimeoutError, ClientStopped):
        return None
