"""Tool-calling clients finish an agent loop against `rollout serve --tool-call-parser hermes
--enable-auto-tool-choice`: the official `openai` client (whole and streamed replies),
langchain-openai and litellm receive parsed tool calls, run the tool, send its result back and
get the final answer. The model is a tiny checkpoint trained here to answer by heart."""

from __future__ import annotations

import json

import openai
import pytest
from http_checkpoint import serve
from tool_model import ANSWER, QUESTION, TOOLS, train_tool_model

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

MODEL = "toolm"


def calc(expr: str) -> str:
    a, b = expr.split("*")
    return str(int(a) * int(b))


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    ckpt = train_tool_model(tmp_path_factory.mktemp("tools") / "model")
    with serve(ckpt, "--served-model-name", MODEL, "--tool-call-parser", "hermes",
               "--enable-auto-tool-choice") as url:  # fmt: skip
        yield url


def test_openai_agent_loop(url):
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages: list = [{"role": "user", "content": QUESTION}]
    kw = dict(model=MODEL, tools=TOOLS, temperature=0, max_tokens=90)
    first = oai.chat.completions.create(messages=messages, **kw).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content == "Let me compute."
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.function.name == "calc" and call.id
    args = json.loads(call.function.arguments)
    assert args == {"expr": "6*7"}

    # streamed, as the openai client accumulates deltas: the same call
    content, calls = "", {}
    for chunk in oai.chat.completions.create(messages=messages, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                acc = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                acc["name"] += (d.function and d.function.name) or ""
                acc["arguments"] += (d.function and d.function.arguments) or ""
            if c.finish_reason:
                assert c.finish_reason == "tool_calls"
    assert content == "Let me compute." and len(calls) == 1
    assert calls[0]["name"] == "calc" and json.loads(calls[0]["arguments"]) == args

    messages.append(first.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(**args)})
    final = oai.chat.completions.create(messages=messages, **kw).choices[0]
    assert final.finish_reason == "stop" and final.message.content == ANSWER
    assert not final.message.tool_calls


def test_langchain_agent_loop(url):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool("calc")
    def calc_tool(expr: str) -> str:
        """evaluate arithmetic"""
        return calc(expr)

    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=MODEL, temperature=0,
                     max_tokens=90, max_retries=0).bind_tools([calc_tool])  # fmt: skip
    messages: list = [HumanMessage(QUESTION)]
    reply = llm.invoke(messages)
    assert [c["name"] for c in reply.tool_calls] == ["calc"]
    messages.append(reply)
    for c in reply.tool_calls:
        messages.append(ToolMessage(calc_tool.invoke(c["args"]), tool_call_id=c["id"]))
    assert llm.invoke(messages).content == ANSWER


def test_litellm_agent_loop(url):
    litellm = pytest.importorskip("litellm")
    kw = dict(model=f"openai/{MODEL}", api_base=f"{url}/v1", api_key="unused", tools=TOOLS,
              temperature=0, max_tokens=90)  # fmt: skip
    messages: list = [{"role": "user", "content": QUESTION}]
    reply = litellm.completion(messages=messages, **kw).choices[0]
    assert reply.finish_reason == "tool_calls"
    (call,) = reply.message.tool_calls
    messages.append(reply.message.model_dump(exclude_none=True))
    result = calc(**json.loads(call.function.arguments))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    assert litellm.completion(messages=messages, **kw).choices[0].message.content == ANSWER
