"""OpenAI's generating routes, `POST /v1/completions` and `POST /v1/chat/completions`: the
prompt tokenized here (or the chat template rendered), the request bounded and admitted
(limits.py), then answered whole or streamed (streaming.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout.serving.http import structured, tool_choice
from rollout.serving.http.backend import Backend
from rollout.serving.http.chat import prepare_messages, render_chat
from rollout.serving.http.choices import cached_tokens, choice_body, scores_only, token_usage
from rollout.serving.http.limits import caller_of, check_logprobs
from rollout.serving.http.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    bad_request,
    sampling_params,
)
from rollout.serving.http.scoring import engine_choices, share_prompt_scores
from rollout.serving.http.streaming import ended, stream_chunks
from rollout.serving.http.submit import check_wait, submit, wait_or_abort
from rollout.serving.http.text_checks import refuse_lone_surrogates

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    be = request.app.state.backend
    refuse_lone_surrogates(req)
    prompts = await be.off_loop(_completion_prompts, be, req)
    return await _generate(be, req, request, prompts, chat=False)


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, request: Request) -> Response:
    be = request.app.state.backend
    refuse_lone_surrogates(req)
    tool_choice.parser_for(be, req)  # 400 before anything runs
    prompt = await be.off_loop(_chat_prompt, be, req)
    return await _generate(be, req, request, [prompt], chat=True)


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
        await check_wait(be, req, request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            stream = stream_chunks(be, req, prompts, sps, chat, rid, ticket)
            ticket.release_with(stream)  # a stream that never starts never reaches its finally
            streaming = True
            return StreamingResponse(ended(stream), media_type="text/event-stream")
        ran = engine_choices(req, sps)  # a prompt's log-probs once for its n choices
        key = request.headers.get("x-session-id") or None  # session-affine routing
        records = await wait_or_abort(be, submit(be, prompts, ran, key), request)
        records = share_prompt_scores(records, len(sps), len(ran))
    finally:
        if not streaming:
            ticket.release()
    generated = [0 if scores_only(req) else len(r.generated_tokens) for r in records]
    usage = token_usage(prompts, len(sps), generated)
    usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens(records, len(sps))}
    be.metrics.tokens(usage["prompt_tokens"], usage["completion_tokens"])
    return await be.off_loop(_answer, be, req, prompts, len(sps), records, chat, rid, usage)


def _answer(be: Backend, req: Any, prompts: list[list[int]], n: int, records: list, chat: bool,
            rid: str, usage: dict) -> Response:  # fmt: skip
    """The unstreamed answer, decoded and serialized (on the text thread: it can be big)."""
    choices = [choice_body(be, req, i, prompts[i // n], rec, chat) for i, rec in enumerate(records)]
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": be.model_name,
                         "choices": choices, "usage": usage})  # fmt: skip
