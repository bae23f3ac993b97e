"""The ASGI app: OpenAI routes in front of the coordinator, joined as an InferenceClient.

Text prompts are tokenized here (with the model's tokenizer, exactly as an engine would) so a
response can return the exact prompt ids; generation always returns the ids, per-token log-probs
and the weight version of every token. While engines are paused or suspended the coordinator
holds requests, so they simply wait; a caller that asks not to wait (`X-Rollout-No-Wait: 1` or
`"wait": false`) gets 503 instead. A caller that disconnects aborts its requests. How much work
a request may ask for, and how much is in flight at once, is bounded (`limits.py`: 400 / 429).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.detokenizer import TextOffsets
from rollout.engine.errors import RequestError
from rollout.sampling import VLLM_LOGPROBS_MODES, SamplingParams
from rollout.serving.auth import tokens_match
from rollout.serving.client import InferenceClient, Partial
from rollout.serving.client_errors import ClientStopped, RequestFailed
from rollout.serving.http import structured, tool_choice
from rollout.serving.http.areal_routes import areal_router, as_token_ids
from rollout.serving.http.body_limit import BodyLimit
from rollout.serving.http.chat import prepare_messages, render_chat
from rollout.serving.http.control import Control
from rollout.serving.http.generate_route import generate_router
from rollout.serving.http.limits import Admission, Limits, Ticket, caller_of, check_logprobs
from rollout.serving.http.metrics import HTTPMetrics, route_label
from rollout.serving.http.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    bad_request,
    finish_reason,
    sampling_params,
)
from rollout.serving.http.scoring import (
    completion_logprobs,
    engine_choices,
    share_prompt_scores,
    token_logprobs,
)
from rollout.serving.http.sglang_routes import sglang_router
from rollout.serving.http.stream_text import StreamedText
from rollout.serving.http.text_checks import refuse_lone_surrogates
from rollout.serving.http.token_routes import router as token_router
from rollout.serving.http.tool_parsers import PARSERS, ToolStream
from rollout.serving.http.vllm_control import vllm_router
from rollout.tokenizers import detokenize_with, tokenize_with

log = logging.getLogger(__name__)

NO_WAIT_HEADER = "x-rollout-no-wait"
_CALLER_ERRORS = {RequestError.__name__, ValueError.__name__}  # engine refusals of the request


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


def _error(e: APIError) -> Response:
    # ASCII JSON: a message quoting the caller's input can hold text UTF-8 cannot encode
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers,
                    media_type="application/json")  # fmt: skip


def build_app(
    address: str,
    *,
    auth_token: str | None = None,
    tokenizer: Any = None,
    model_name: str = "model",
    chat_template: str | None = None,
    special_tokens: dict[str, str] | None = None,
    http_token: str | None = None,
    logprobs_mode: str = "raw_logprobs",
    limits: Limits | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    body_limits: dict[str, int] | None = None,
    model_source: str | None = None,
) -> FastAPI:
    """The app for the coordinator at `address` (joined with its `auth_token`). `http_token`:
    the bearer token every route but /health requires (None: no HTTP auth).
    `logprobs_mode`: vLLM's spelling, for requests that name none. `limits`: the work it admits
    (default: `Limits()`). `tool_call_parser` (a tool_parsers.PARSERS name) with
    `enable_auto_tool_choice` parses tool calls out of chat replies, as vLLM's flags of the
    same names. `body_limits`: request body caps by route (body_limit.BODY_LIMITS' keys).
    `model_source` (`rollout serve --model`): what weight updates from a folder are checked
    against (None: those routes answer 501)."""
    if logprobs_mode not in VLLM_LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {sorted(VLLM_LOGPROBS_MODES)}, got {logprobs_mode!r}")  # fmt: skip
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(
            f"unknown tool_call_parser {tool_call_parser!r}; use one of {sorted(PARSERS)}"
        )
    be = Backend(address, auth_token, tokenizer, model_name, chat_template,
                 special_tokens or {}, http_token, limits or Limits())  # fmt: skip
    be.logprobs_mode = logprobs_mode
    be.tool_call_parser, be.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice
    be.control = Control(be, address, auth_token, model_source)  # vLLM/SGLang/AReaL routes

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await be.client.start()  # on uvicorn's loop: the client's futures live there
        try:
            yield
        finally:
            be.control.close()
            be.client.stop()
            be.text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.backend = be
    gen_router = generate_router(_check_wait, _submit, _wait_or_abort)
    app.include_router(token_router)
    app.include_router(gen_router)
    extra_routers = (vllm_router(), sglang_router(_check_wait, _submit, _wait_or_abort),
                     areal_router())  # fmt: skip
    for router in extra_routers:
        app.include_router(router)
    labelled: list = []  # every route with its template, the included routers' too (below)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        # /inference/v1/generate's sampling_params are parameters in their own right
        param = loc[1] if len(loc) > 1 and loc[0] == "sampling_params" else (loc or [None])[0]
        return _error(bad_request(msg, param))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        return _error(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    app.add_middleware(BodyLimit, limits=body_limits or {})  # inside auth and metrics

    @app.middleware("http")
    async def _auth_and_metrics(request: Request, call_next: Callable) -> Response:
        path = request.url.path
        route = route_label(labelled, request.scope)
        guarded = path != "/health"  # /v1, /metrics, and vLLM's root routes (token_routes)
        if guarded and be.http_token is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not tokens_match(given, be.http_token):
                be.metrics.request_done(route, 401, 0.0)
                return _error(APIError(401, "invalid or missing bearer token",
                                       "invalid_request_error", code="invalid_api_key"))  # fmt: skip
        t0 = time.perf_counter()
        response = await call_next(request)
        be.metrics.request_done(route, response.status_code, time.perf_counter() - t0)
        return response

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    card = {"id": be.model_name, "object": "model", "created": be.created, "owned_by": "rollout"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != be.model_name:
            raise APIError(404, f"model {model_id!r} does not exist (this server serves "
                                f"{be.model_name!r})", param="model", code="model_not_found")  # fmt: skip
        return card

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await _stats(be)
        return Response(be.metrics.render(stats), media_type=be.metrics.content_type)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        refuse_lone_surrogates(req)
        prompts = await be.off_loop(_completion_prompts, be, req)
        return await _generate(be, req, request, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Response:
        refuse_lone_surrogates(req)
        tool_choice.parser_for(be, req)  # 400 before anything runs
        prompt = await be.off_loop(_chat_prompt, be, req)
        return await _generate(be, req, request, [prompt], chat=True)

    # FastAPI >= 0.165 keeps an included router as one route without a template: label by the
    # routers' own routes (included without a prefix, so their templates are the app's)
    for r in (*app.router.routes, *token_router.routes, *gen_router.routes,
              *(route for router in extra_routers for route in router.routes)):  # fmt: skip
        if getattr(r, "path", None):
            labelled.append(r)
    return app


# ---- prompts --------------------------------------------------------------------------------


def _completion_prompts(be: Backend, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        batch: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        batch = [p]
    else:
        batch = list(p)
    if not batch or any(not x for x in batch):
        raise bad_request("prompt must not be empty", "prompt")
    return [be.tokenize(x, bos=True) if isinstance(x, str) else list(x) for x in batch]


def _chat_prompt(be: Backend, req: ChatRequest) -> list[int]:
    if req.prompt_token_ids:
        return list(req.prompt_token_ids)
    if be.chat_template is None:
        raise bad_request(f"model {be.model_name!r} has no chat template: use /v1/completions "
                          "or start the server with --chat-template", "messages")  # fmt: skip
    try:
        messages = prepare_messages(req.messages)
        text = render_chat(be.chat_template, messages, req.add_generation_prompt,
                           tools=req.tools, **be.special_tokens)  # fmt: skip
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return be.tokenize(text, bos=False)  # the template writes the BOS itself, as in HF


# ---- generation -----------------------------------------------------------------------------


async def _stats(be: Backend) -> dict | None:
    try:
        return await asyncio.wait_for(be.client.stats(), 5.0)
    except (asyncio.TimeoutError, ClientStopped):
        return None


async def _check_wait(be: Backend, req: Any, request: Request) -> None:
    be.control.check_weights()  # discarded weights: a 409 now, not a request held for ever
    if req.wait and request.headers.get(NO_WAIT_HEADER, "") not in ("1", "true"):
        await be.control.admitted()  # a pause(wait) drains: new requests wait here
        return
    stats = await _stats(be)
    state = "DRAINING" if be.control.draining else stats["state"] if stats else "UNREACHABLE"
    if state != "RUNNING":
        raise APIError(503, f"engines are {state} and the request asked not to wait",
                       "service_unavailable_error", code="engines_not_running")  # fmt: skip


def _submit(be: Backend, prompts: list[list[int]], sps: list[SamplingParams],
            routing_key: str | None = None) -> list[Any]:  # fmt: skip
    futures: list[Any] = []
    try:
        for p in prompts:
            futures += [be.client.add_request(p, sp, routing_key=routing_key) for sp in sps]
        return futures
    except ValueError as e:
        for f in futures:  # all choices or none
            be.client.abort(f)
        raise bad_request(str(e), "prompt") from None
    except ClientStopped as e:
        raise APIError(503, str(e), "service_unavailable_error") from None


async def _generate(be: Backend, req: Any, request: Request, prompts: list[list[int]],
                    chat: bool) -> Response:  # fmt: skip
    if req.model and req.model != be.model_name:
        raise APIError(404, f"model {req.model!r} does not exist (this server serves "
                            f"{be.model_name!r})", param="model", code="model_not_found")  # fmt: skip
    sps = sampling_params(req, be.logprobs_mode)
    sps = structured.constrain(sps, structured.openai_specs(req, be.tool_call_parser))
    check_logprobs(req, be.limits)
    ticket = be.admission.admit(prompts, sps, caller_of(request))
    streaming = False
    try:
        await _check_wait(be, req, request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            stream = _stream(be, req, prompts, sps, chat, rid, ticket)
            ticket.release_with(stream)  # a stream that never starts never reaches its finally
            streaming = True
            return StreamingResponse(_ended(stream), media_type="text/event-stream")
        ran = engine_choices(req, sps)  # a prompt's log-probs once for its n choices
        key = request.headers.get("x-session-id") or None  # session-affine routing
        records = await _wait_or_abort(be, _submit(be, prompts, ran, key), request)
        records = share_prompt_scores(records, len(sps), len(ran))
    finally:
        if not streaming:
            ticket.release()
    generated = [0 if _scores_only(req) else len(r.generated_tokens) for r in records]
    usage = _usage(prompts, len(sps), generated)
    usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens(records, len(sps))}
    be.metrics.tokens(usage["prompt_tokens"], usage["completion_tokens"])
    return await be.off_loop(_answer, be, req, prompts, len(sps), records, chat, rid, usage)


def _answer(be: Backend, req: Any, prompts: list[list[int]], n: int, records: list, chat: bool,
            rid: str, usage: dict) -> Response:  # fmt: skip
    """The unstreamed answer, decoded and serialized (on the text thread: it can be big)."""
    choices = [_choice(be, req, i, prompts[i // n], rec, chat) for i, rec in enumerate(records)]
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": be.model_name,
                         "choices": choices, "usage": usage})  # fmt: skip


async def _wait_or_abort(be: Backend, futures: list, request: Request) -> list:
    """The merged records; a client that disconnects first aborts them all (uvicorn answers
    `receive()` with http.disconnect once the connection drops: no polling)."""
    gathered = asyncio.gather(*futures)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({gathered, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            for f in futures:
                if not f.done():
                    be.client.abort(f)
            be.metrics.disconnects.inc()
            gathered.cancel()
            with contextlib.suppress(BaseException):
                await gathered
            raise APIError(499, "client disconnected", code="client_closed_request")
        try:
            records = [r.merge() for r in gathered.result()]
        except RequestFailed as e:
            raise APIError(500, str(e), "server_error") from None
        for rec in records:
            if (err := _failure(rec)) is not None:
                raise err
        return records
    finally:
        watch.cancel()


def _failure(rec: Any) -> APIError | None:
    """The error a failed record answers with: the engine's ValueError (a prompt it refused,
    e.g. a token id past the vocabulary) is the caller's 400, anything else a 500."""
    if not rec.failed():
        return None
    errors = [
        e.payload for e in rec.events if isinstance(e.payload, dict) and "message" in e.payload
    ]
    last = errors[-1] if errors else {"type": "RuntimeError", "message": "request failed"}
    if last.get("type") in _CALLER_ERRORS:
        return bad_request(last["message"], "prompt")
    return APIError(500, f"request failed: {last['message']}", "server_error")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def cached_tokens(records: list, n: int) -> int:
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache
    served, once per prompt (its first choice's), as prompt_tokens counts them."""
    return sum(int(r.cached_tokens) for r in records[::n])


def _usage(prompts: list[list[int]], n: int, generated: list[int]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n, as OpenAI counts
    completion = sum(generated)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}  # fmt: skip


def _scores_only(req: Any) -> bool:
    return isinstance(req, CompletionRequest) and req.scores_only()


def _choice(be: Backend, req: Any, index: int, prompt: list[int], rec: Any, chat: bool) -> dict:
    tokens = list(rec.generated_tokens)
    text = rec.generated_text if rec.generated_text is not None else be.text(tokens)
    ext = {"token_ids": tokens, "token_logprobs": list(rec.generated_log_probs),
           "weight_versions": list(rec.generated_weight_versions), "prompt_token_ids": prompt}  # fmt: skip
    reason = finish_reason(rec.stop_reason)
    if chat:
        lp = (
            _chat_logprobs(be, tokens, rec.generated_log_probs, _tops(rec, len(tokens)))
            if req.logprobs
            else None
        )
        msg, reason = tool_choice.message(be, req, rec, text, reason)
        return {"index": index, "message": msg, "logprobs": lp, "finish_reason": reason, **ext}
    if req.scores_only():  # nothing generated: the token the prompt's forward sampled is dropped
        text, reason = "", "length"
        ext.update(token_ids=[], token_logprobs=[], weight_versions=[])
    if (req.model_extra or {}).get("skip_special_tokens") is False and be.tokenizer is not None:
        text = be.tokenizer.decode(tokens, skip_special_tokens=False)  # schemas: unstreamed only
    if req.echo:
        text = be.text(prompt) + text
    lp = None
    if req.logprobs is not None:
        gen_tops = [] if req.scores_only() else _tops(rec, len(tokens))
        lp = completion_logprobs(be.text, prompt if req.echo else None, rec, gen_tops)
        if req.return_tokens_as_token_ids:  # AReaL's vLLM path
            ptops = [None, *(rec.prompt_top_n_logprobs or [{}] * (len(prompt) - 1))]
            lp = as_token_ids(lp, [*(prompt if req.echo else []), *(tokens if gen_tops else [])],
                              [*(ptops if req.echo else []), *gen_tops])  # fmt: skip
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason, **ext}


def _tops(rec: Any, n: int, start: int = 0) -> list[dict]:
    """Top log-probs of generated tokens start..start+n ({} each when none were asked)."""
    return _one_per_token(rec.generated_top_n_logprobs[start : start + n], n)


def _one_per_token(tops: list[dict], n: int) -> list[dict]:
    """`tops` aligned to the last of `n` tokens: tokens resumed from another engine's
    checkpoint after a failover carry no top-n, and get {}."""
    return [{}] * (n - len(tops)) + list(tops[-n:] if n else [])


def _chat_logprobs(be: Backend, tokens: list[int], lps: list[float], tops: list[dict]) -> dict:
    def entry(tid: int, lp: float) -> dict:
        s = be.text([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(k, v) for k, v in top.items()]}
                        for t, lp, top in zip(tokens, lps, tops, strict=True)]}  # fmt: skip


# ---- streaming ------------------------------------------------------------------------------


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _ended(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
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
    return _one_per_token([{int(k): v for k, v in t.items()} for t in tops or []], n)


async def _stream(be: Backend, req: Any, prompts: list[list[int]], sps: list[SamplingParams],
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
        return _usage([jobs[i][0]], 1, [sent_tokens[i]])

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
                if (err := _failure(rec)) is not None:
                    yield _sse(err.body())
                    continue
                n = sent_tokens[i]
                tokens = list(rec.generated_tokens[n:])
                lps = list(rec.generated_log_probs[n:])
                versions = list(rec.generated_weight_versions[n:])
                tops = _tops(rec, len(tokens), n)
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
                lp = _chat_logprobs(be, tokens, lps, tops)
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
            usage = _usage(prompts, len(sps), sent_tokens)
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
