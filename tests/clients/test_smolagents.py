"""smolagents' ToolCallingAgent, as shipped, against `rollout serve --tool-call-parser hermes`:
it sends `tool_choice: "required"` with every call, which the server honours by constraining
generation to Hermes tool calls whose arguments follow each tool's schema, so even the tiny
random model completes an agent step: a parsed call, the tool run, its observation recorded."""

from __future__ import annotations

import pytest
from http_serve import HTTP_TOKEN, serve_http

pytest.importorskip("xgrammar")
smolagents = pytest.importorskip("smolagents")
pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]


class PickColor(smolagents.Tool):
    name = "pick_color"
    description = "Pick one color for the user."
    inputs = {"color": {"type": "string", "description": "the color", "enum": ["red", "blue"]}}
    output_type = "string"

    def forward(self, color: str) -> str:
        return f"picked {color}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = serve_http(tmp_path_factory.mktemp("smolagents"), "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice")  # fmt: skip
    yield server
    server.stop()


def test_tool_calling_agent_completes_a_step(served):
    # plain OpenAI request options (the prompt is 3.4k byte tokens of the 4k context); one call
    # per reply, since a random model would otherwise chain calls past final_answer
    model = smolagents.OpenAIServerModel(model_id="tiny", api_base=served.base,
                                         api_key=HTTP_TOKEN, max_tokens=600, seed=0,
                                         parallel_tool_calls=False)  # fmt: skip
    agent = smolagents.ToolCallingAgent(tools=[PickColor()], model=model, max_steps=1)
    agent.run("Pick a color for me.")
    steps = [s for s in agent.memory.steps if isinstance(s, smolagents.ActionStep)]
    assert steps, agent.memory.steps
    step = steps[0]
    assert step.error is None, step.error
    assert step.tool_calls and step.tool_calls[0].name in ("pick_color", "final_answer")
    if step.tool_calls[0].name == "pick_color":
        assert step.observations in ("picked red", "picked blue")
