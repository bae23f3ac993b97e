"""rollout.rl.tools: call parsing, tool errors as observations, limits, rewards (no engine)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout.rl.tools import ToolCall, ToolCallSyntax, ToolEnvironment, ToolError, run_tool
from rollout.sampling import SamplingParams
from rollout.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def calc(args: str) -> str:
    a, b = args.split("*")
    return str(int(a) * int(b))


async def async_upper(args: str) -> str:
    await asyncio.sleep(0)
    return args.upper()


def exact(example: dict, answer: str) -> float:
    return 1.0 if answer == example["answer"] else 0.0


def make_env(**kwargs) -> ToolEnvironment:
    opts = {"tools": {"calc": calc, "upper": async_upper}, "tokenizer": TOK,
            "prompt": lambda ex: ex["prompt"], "reward": exact, **kwargs}  # fmt: skip
    return ToolEnvironment(**opts)


def play(env: ToolEnvironment, turns: list[str], example: dict | None = None) -> list:
    """Reset, then one step per model turn (eos appended to a turn ending in "$")."""
    example = example or {"prompt": "12*3=", "answer": "36"}

    async def go() -> list:
        out = [await env.reset(example)]
        for t in turns:
            ids = TOK.encode(t.removesuffix("$")) + ([TOK.eos_id] if t.endswith("$") else [])
            out.append(await env.step(ids))
        return out

    return asyncio.run(go())


def text(step) -> str:
    return TOK.decode(step.observation)


@pytest.mark.parametrize(
    ("syntax", "turn", "call"),
    [
        (ToolCallSyntax(), "x <calc>12*3</calc>", ToolCall("calc", "12*3")),
        (ToolCallSyntax(), "<upper>a b</upper><calc>1</calc>", ToolCall("upper", "a b")),
        (ToolCallSyntax(), "no call here", None),
        (ToolCallSyntax("[[", "]]", tool="calc"), "so [[2*5]]", ToolCall("calc", "2*5")),
        (ToolCallSyntax("CALL {name}(", ")", ), "CALL calc(4*4)", ToolCall("calc", "4*4")),
    ],
)  # fmt: skip
def test_parse(syntax, turn, call):
    assert syntax.parse(turn) == call


def test_parse_malformed_and_bad_syntax():
    with pytest.raises(ToolError, match="without '</calc>'"):
        ToolCallSyntax().parse("<calc>12*3")
    with pytest.raises(ValueError, match=r"must contain \{name\}"):
        ToolCallSyntax(start="<calc>")
    with pytest.raises(ValueError, match="non-empty tag"):
        ToolCallSyntax(start="", end="]", tool="calc")
    with pytest.raises(ValueError, match="not a registered tool"):
        make_env(syntax=ToolCallSyntax("[", "]", tool="search"))


def test_two_turn_episode_with_sync_tool_and_reward_at_the_final_turn():
    env = make_env()
    prompt, call, answer = play(env, ["<calc>12*3</calc>", "36$"])
    assert prompt == TOK.encode("12*3=", add_bos=True)
    assert text(call) == "36\n" and not call.done and call.reward == 0.0
    assert call.info == {"tool_calls": 1.0, "tool_errors": 0.0}
    assert answer.done and answer.reward == 1.0 and answer.observation == []
    assert answer.info == {"tool_calls": 0.0, "tool_errors": 0.0}


def test_wrong_or_cut_off_answer_earns_nothing():
    assert play(make_env(), ["35$"])[1].reward == 0.0
    cut = play(make_env(), ["36"])[1]  # no eos: cut off by the token budget
    assert cut.done and cut.reward == 0.0
    assert play(make_env(require_stop=False), ["36"])[1].reward == 1.0


def test_async_tool():
    step = play(make_env(), ["<upper>abc</upper>"])[1]
    assert text(step) == "ABC\n" and step.info["tool_errors"] == 0.0


def test_errors_are_observations():
    def broken(args: str) -> str:
        raise ZeroDivisionError("division by zero")

    env = make_env(tools={"calc": calc, "broken": broken})
    _, exc, unknown, malformed, answer = play(
        env, ["<broken>1</broken>", "<search>x</search>", "<calc>1*2", "36$"]
    )
    assert text(exc) == "error: ZeroDivisionError: division by zero\n"
    assert text(unknown) == "error: unknown tool 'search'; tools: broken, calc\n"
    assert text(malformed).startswith("error: malformed call")
    for step in (exc, unknown, malformed):
        assert not step.done and step.info == {"tool_calls": 1.0, "tool_errors": 1.0}
    assert answer.done and answer.reward == 1.0  # the episode went on after the errors


def test_timeout_is_an_observation_for_sync_and_async_tools():
    release = threading.Event()

    def hangs(args: str) -> str:
        release.wait(10)
        return "late"

    async def hangs_async(args: str) -> str:
        await asyncio.Event().wait()

    env = make_env(tools={"slow": hangs, "aslow": hangs_async}, timeout_s=0.05)

    async def go() -> list:
        await env.reset({"prompt": "1=", "answer": "1"})
        try:
            return [await env.step(TOK.encode(t)) for t in ("<slow>1</slow>", "<aslow>1</aslow>")]
        finally:
            release.set()  # the abandoned worker thread returns before the loop shuts down

    sync_step, async_step = asyncio.run(go())
    assert text(sync_step) == "error: timed out after 0.05s\n"
    assert text(async_step) == "error: timed out after 0.05s\n"
    assert sync_step.info["tool_errors"] == async_step.info["tool_errors"] == 1.0


def test_call_limit():
    steps = play(make_env(max_tool_calls=2), ["<calc>1*2</calc>"] * 3)[1:]
    assert [text(s) for s in steps[:2]] == ["2\n", "2\n"]
    assert text(steps[2]) == "error: tool call limit reached (2 per episode)\n"
    assert steps[2].info == {"tool_calls": 1.0, "tool_errors": 1.0}


def test_reset_starts_a_fresh_count_and_encodes_text_prompts():
    env = make_env(max_tool_calls=1)
    play(env, ["<calc>1*2</calc>"])
    _, step = play(env, ["<calc>1*2</calc>"], {"prompt": [5, 6], "answer": "2"})
    assert text(step) == "2\n"
    assert asyncio.run(env.reset({"prompt": [5, 6]})) == [5, 6]


def test_sampling_params_stop_at_the_end_tags():
    base = SamplingParams(stop_words=["\n\n"], stop_token_ids=[TOK.eos_id])
    sp = make_env().sampling_params(base)
    assert sp.stop_words == ["\n\n", "</calc>", "</upper>"]
    assert sp.stop_token_ids == [TOK.eos_id] and base.stop_words == ["\n\n"]
    fixed = make_env(syntax=ToolCallSyntax("[[", "]]", tool="calc")).sampling_params(base)
    assert fixed.stop_words == ["\n\n", "]]"]
    shared = make_env(syntax=ToolCallSyntax("CALL {name}(", ")")).sampling_params(base)
    assert shared.stop_words == ["\n\n", ")"]  # one end tag for every tool


def test_factory_builds_fresh_environments_and_checks_arguments_once():
    factory = ToolEnvironment.factory({"calc": calc}, TOK, lambda ex: ex["prompt"], exact)
    a, b = factory({}), factory({})
    assert isinstance(a, ToolEnvironment) and a is not b
    with pytest.raises(ValueError, match="tool name"):
        ToolEnvironment.factory({"bad name": calc}, TOK, lambda ex: "", exact)
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        ToolEnvironment.factory({"calc": calc}, TOK, lambda ex: "", exact, timeout_s=0)
    with pytest.raises(ValueError, match=r"result_format must be a str containing \{result\}"):
        ToolEnvironment.factory({"calc": calc}, TOK, lambda ex: "", exact, result_format="x")


def test_run_tool_passes_through_the_tool_exception():
    def bad(args: str) -> str:
        raise KeyError(args)

    with pytest.raises(KeyError):
        asyncio.run(run_tool(bad, "k", 1.0))
    assert asyncio.run(run_tool(lambda a: 7, "", 1.0)) == "7"
