"""Streamed /v1 answers: server-sent events, one chunk per streamed partial of any choice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from rollout.detokenizer import TextOffsets
from rollout.sampling import SamplingParams
from rollout.serving.client import Partial
from rollout.serving.http import tool_choice
from rollout.serving.http.backend import Backend
from rollout.serving.http.choices import chat_logprobs, generated_tops, one_per_token, token_usage
from rollout.serving.http.limits import Ticket
from rollout.serving.http.schemas import APIError, finish_reason
from rollout.serving.http.scoring import token_logprobs
from rollout.serving.http.stream_text import StreamedText
from rollout.serving.http.submit import failure
from rollout.serving.http.tool_parsers import ToolStream

log = logging.getLogger(__name__)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def ended(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`stream`, ended by an error event and `data: [DONE]` should it fail midway: a fault in
    building one chunk must not leave the caller waiting for an end that never comes."""
    async with contextlib.aclosing(stream):
        try:
            async for chunk in stream:
                yield chunk
        except Exception as e:
            log.exception("a stream failed midway")
            yield _sse(APIError(500, f"internal error: {type(e).__name__}", "server_error").body())
            yield b"data: [DONE]\n\n"


def _partial_tops(item: Partial, n: int) -> list[dict]:
    """The top log-probs a partial carries for its `n` tokens ({} each when none were asked)."""
    tops = item.extra.get("top_n_logprobs") if isinstance(item.extra, dict) else None
    return one_per_token([{int(k): v for k, v in t.items()} for t in tops or []], n)


async def stream_chunks(be: Backend, req: Any, prompts: list[list[int]], sps: list[SamplingParams],
                  chat: bool, rid: str, ticket: Ticket) -> AsyncIterator[bytes]:  # fmt: skip
    """Server-sent events: one chunk per streamed partial of any choice, each choice's last
    chunk carrying its finish_reason, then `data: [DONE]`. Starlette cancels this generator when
    the caller disconnects; closing each choice's client stream then aborts its request. Asked
    log-probs come in each chunk in the unstreamed shape, for that chunk's tokens."""
    queue: asyncio.Queue = asyncio.Queue()
    jobs = [(p, sp) for p in prompts for sp in sps]
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    async def pump(index: int, prompt: list[int], sp: SamplingParams) -> None:
        try:
            async with contextlib.aclosing(be.client.stream(prompt, sp)) as parts:
                async for item in parts:
                    await queue.put((index, item))
        except Exception as e:
            await queue.put((index, e))
        finally:  # the engines are done with this choice (or it was aborted): its share is free
            ticket.release_choice(index)
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, p, sp)) for i, (p, sp) in enumerate(jobs)]
    sent_tokens = [0] * len(jobs)
    offsets = [TextOffsets(be.text) for _ in jobs]  # each choice's text, as it streams
    want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
    live = len(jobs)
    hold = max((len(w) for w in sps[0].stop_words), default=1) - 1  # as vLLM holds back
    texts = [StreamedText(be.text, hold) for _ in jobs]  # decoded once per token
    parser = tool_choice.parser_for(be, req) if chat else None
    tool_streams = [ToolStream(parser) for _ in jobs] if parser else None
    replies = [StreamedText(tool_choice.reply_decoder(be), hold) for _ in jobs] if parser else []
    calls: list[dict] = []
    continuous = req.continuous_usage()

    def usage_of(i: int) -> dict:  # continuous_usage_stats: the choice's counts so far (vLLM's)
        return token_usage([jobs[i][0]], 1, [sent_tokens[i]])

    try:
        if chat:
            for i in range(len(jobs)):
                yield _sse({"id": rid, "object": obj, "created": created, "model": be.model_name,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                            **({"usage": usage_of(i)} if continuous else {})})  # fmt: skip
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
                continue
            if isinstance(item, Exception):
                err = APIError(500, f"request failed: {item}", "server_error")
                yield _sse(err.body())
                continue
            if isinstance(item, Partial):
                tokens, lps, versions, reason = (
                    item.tokens,
                    item.log_probs,
                    item.weight_versions,
                    None,
                )
                tops = _partial_tops(item, len(tokens))
                texts[i].add(tokens)  # an incomplete UTF-8 character is held until it resolves
                delta = texts[i].delta()  # the end that may start a stop word is held too
                if tool_streams:  # content until a call may have begun
                    replies[i].add(tokens)
                    delta = tool_streams[i].content(replies[i].stable())
            else:  # the final record: whatever the partials did not carry
                rec = item.merge()
                if (err := failure(rec)) is not None:
                    yield _sse(err.body())
                    continue
                n = sent_tokens[i]
                tokens = list(rec.generated_tokens[n:])
                lps = list(rec.generated_log_probs[n:])
                versions = list(rec.generated_weight_versions[n:])
                tops = generated_tops(rec, len(tokens), n)
                reason = finish_reason(rec.stop_reason)
                full = texts[i].finish(tokens)
                if rec.generated_text is not None:  # cut at a stop string
                    full = rec.generated_text
                sent = texts[i].sent
                delta = full[len(sent) :] if full.startswith(sent) else ""
                if tool_streams:  # the rest of the content, then the calls
                    single = req.parallel_tool_calls is False
                    text = tool_choice.reply_text(be, rec)
                    delta, calls, called = tool_streams[i].finish(text, single)
                    reason = "tool_calls" if called else reason
                be.metrics.tokens(len(jobs[i][0]) if i % len(sps) == 0 else 0,
                                  len(rec.generated_tokens))  # fmt: skip
            sent_tokens[i] += len(tokens)
            ext = {"token_ids": tokens, "token_logprobs": lps, "weight_versions": versions}
            lp = None
            if want_logprobs and chat:
                lp = chat_logprobs(be, tokens, lps, tops)
            elif want_logprobs:
                lp = token_logprobs(be.text, tokens, lps, tops, offsets[i])
            if chat:
                choice = {"index": i, "delta": {"content": delta} if delta else {},
                          "logprobs": lp, "finish_reason": reason, **ext}  # fmt: skip
                if calls:
                    choice["delta"]["tool_calls"], calls = calls, []
            else:
                choice = {"index": i, "text": delta, "logprobs": lp, "finish_reason": reason,
                          **ext}  # fmt: skip
            if reason is not None:
                choice["prompt_token_ids"] = jobs[i][0]
            yield _sse({"id": rid, "object": obj, "created": created, "model": be.model_name,
                        "choices": [choice], **({"usage": usage_of(i)} if continuous else {})})  # fmt: skip
        if req.include_usage():
            usage = token_usage(prompts, len(sps), sent_tokens)
            yield _sse({"id": rid, "object": obj, "created": created, "model": be.model_name,
                        "choices": [], "usage": usage})  # fmt: skip
        yield b"data: [DONE]\n\n"
    finally:
        ticket.release()
        for t in tasks:
            if not t.done():
                t.cancel()
                be.metrics.disconnects.inc()
        await asyncio.gather(*tasks, return_exceptions=True)
