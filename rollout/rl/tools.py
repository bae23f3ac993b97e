"""`ToolEnvironment`: an `Environment` in which the model calls Python tools by writing text.

Each model turn is decoded and searched for a call in the configured syntax (`ToolCallSyntax`,
by default `<name>args</name>`). A call runs the named tool on its argument string, with a timeout
(sync tools in a worker thread, so the episode loop keeps serving other episodes), and the result
goes back to the model as observation text. Whatever goes wrong with a call (unknown tool,
malformed call, an exception, a timeout, the call limit) is also an observation, "error: ...": the
model sees it and may try again, and the episode goes on. A turn without a call is the final
answer: the episode ends with the task's reward for it. Each step's info counts `tool_calls` and
`tool_errors`, which the manager sums per episode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rollout.rl.environment import EnvFactory, Environment, EnvStep
from rollout.sampling import SamplingParams

__all__ = ["ToolCall", "ToolCallSyntax", "ToolEnvironment", "ToolError", "run_tool"]

ToolFn = Callable[[str], Any]  # sync or async; the result is shown to the model as str(result)
RewardFn = Callable[[Any, str], float]  # (example, final answer text) -> reward
PromptFn = Callable[[Any], "list[int] | str"]  # example -> prompt ids, or text to encode

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ToolError(Exception):
    """A call that cannot run (unknown tool, malformed, over the limit) or did not finish."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    args: str


@dataclasses.dataclass(frozen=True)
class ToolCallSyntax:
    """How a call is written.

    Named form (default): `start` contains `{name}` (and `end` may), as in `<calc>2*3</calc>` or
    `CALL calc(2*3)`; any name counts as a call, so an unregistered one is reported as an unknown
    tool. Single-tool form: fixed `start`/`end` tags and `tool` names the tool they call, as in
    `[[2*3]]`. A start tag without its end tag is a malformed call. The end tags are the turn's stop words: generation
    stops right after a call, where the tool runs.
    """

    start: str = "<{name}>"
    end: str = "</{name}>"
    tool: str | None = None

    def __post_init__(self) -> None:
        named = self.tool is None
        for field, tag in (("start", self.start), ("end", self.end)):
            if not isinstance(tag, str) or not tag.replace("{name}", ""):
                raise ValueError(f"ToolCallSyntax.{field} must be a non-empty tag, got {tag!r}")
            if named and tag.count("{name}") > 1:
                raise ValueError(f"ToolCallSyntax.{field}={tag!r} holds {{name}} more than once")
            if not named and "{name}" in tag:
                raise ValueError(f"ToolCallSyntax.{field}={tag!r}: no {{name}} with tool=")
        if named and "{name}" not in self.start:
            raise ValueError(
                f"ToolCallSyntax.start={self.start!r} must contain {{name}} "
                "(or set tool= for the single-tool form)"
            )
        if not named and not _NAME.fullmatch(str(self.tool)):
            raise ValueError(f"ToolCallSyntax.tool must be a tool name, got {self.tool!r}")

    def stop_words(self, names: list[str]) -> list[str]:
        """The end tags of calls to `names` (the single-tool form has one)."""
        if self.tool is not None:
            return [self.end]
        return list(dict.fromkeys(self.end.replace("{name}", n) for n in names))

    def parse(self, text: str) -> ToolCall | None:
        """The first call in `text`; None when there is none; ToolError when it is malformed."""
        if self.tool is not None:
            return self._parse_fixed(text)
        pre, post = self.start.split("{name}")
        opener = re.compile(re.escape(pre) + f"({_NAME.pattern})" + re.escape(post))
        m = opener.search(text)
        if m is None:
            return None
        name = m.group(1)
        close = self.end.replace("{name}", name)
        stop = text.find(close, m.end())
        if stop < 0:
            raise ToolError(f"malformed call: {m.group(0)!r} without {close!r}")
        return ToolCall(name, text[m.end() : stop])

    def _parse_fixed(self, text: str) -> ToolCall | None:
        begin = text.find(self.start)
        if begin < 0:
            return None
        first = begin + len(self.start)
        stop = text.find(self.end, first)
        if stop < 0:
            raise ToolError(f"malformed call: {self.start!r} without {self.end!r}")
        return ToolCall(str(self.tool), text[first:stop])


async def run_tool(fn: ToolFn, args: str, timeout_s: float) -> str:
    """`fn(args)` as text within `timeout_s`: coroutine functions are awaited on this loop, sync
    functions run in a worker thread (a sync tool that hangs keeps its thread until it returns;
    the episode does not wait for it). Raises ToolError on a timeout; the tool's own exceptions
    propagate."""

    async def invoke() -> Any:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 (an object with an async __call__)
        ):
            result = await fn(args)
        else:
            result = await asyncio.to_thread(fn, args)
        if inspect.isawaitable(result):
            result = await result
        return result

    try:
        return str(await asyncio.wait_for(invoke(), timeout_s))
    except TimeoutError as e:
        raise ToolError(f"timed out after {timeout_s:g}s") from e


class ToolEnvironment(Environment):
    """One tool-using episode. Build the manager's `env=` with `ToolEnvironment.factory(...)`.

    tools: name -> callable on the call's argument string (sync or async).
    tokenizer: decodes model turns, encodes observations (`encode(text, add_bos=False)`).
    prompt: example -> the prompt's token ids (used as they are) or its text (encoded with bos
        when the tokenizer has one).
    reward: (example, final answer text) -> reward; the answer is the last turn's text up to its
        eos. An answer cut off before eos earns 0 when `require_stop`.
    syntax: how calls are written (`ToolCallSyntax`).
    timeout_s: per call. max_tool_calls: calls allowed per episode; later ones get an error.
    result_format / error_format: observation text, with `{result}` / `{error}`;
        max_observation_chars cuts long results.
    """

    def __init__(
        self,
        tools: Mapping[str, ToolFn],
        tokenizer: Tokenizer,
        prompt: PromptFn,
        reward: RewardFn,
        *,
        syntax: ToolCallSyntax | None = None,
        timeout_s: float = 5.0,
        max_tool_calls: int = 4,
        result_format: str = "{result}\n",
        error_format: str = "error: {error}\n",
        max_observation_chars: int = 512,
        require_stop: bool = True,
    ) -> None:
        self.tools = _check_tools(tools)
        self.syntax = syntax if syntax is not None else ToolCallSyntax()
        if self.syntax.tool is not None and self.syntax.tool not in self.tools:
            raise ValueError(
                f"ToolCallSyntax.tool={self.syntax.tool!r} is not a registered tool: "
                f"{sorted(self.tools)}"
            )
        if not callable(prompt) or not callable(reward):
            raise ValueError("prompt and reward must be callables")
        _check_positive("timeout_s", timeout_s)
        _check_positive("max_tool_calls", max_tool_calls, integer=True)
        _check_positive("max_observation_chars", max_observation_chars, integer=True)
        for name, fmt, key in (("result_format", result_format, "result"),
                               ("error_format", error_format, "error")):  # fmt: skip
            if not isinstance(fmt, str) or f"{{{key}}}" not in fmt:
                raise ValueError(f"{name} must be a str containing {{{key}}}, got {fmt!r}")
        self.tokenizer, self.prompt, self.reward = tokenizer, prompt, reward
        self.timeout_s, self.max_tool_calls = float(timeout_s), int(max_tool_calls)
        self.result_format, self.error_format = result_format, error_format
        self.max_observation_chars, self.require_stop = max_observation_chars, require_stop
        eos = getattr(tokenizer, "eos_ids", None) or [tokenizer.eos_id]
        self.eos_ids = {int(i) for i in eos}
        self.example: Any = None
        self.calls = 0

    @classmethod
    def factory(cls, *args: Any, **kwargs: Any) -> EnvFactory:
        """An `EnvFactory`: a fresh environment per episode, its arguments checked once now."""
        cls(*args, **kwargs)  # bad arguments fail here, not in every episode
        return lambda example: cls(*args, **kwargs)

    async def reset(self, example: Any) -> list[int]:
        self.example, self.calls = example, 0
        prompt = self.prompt(example)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=self.tokenizer.bos_id is not None)
        return list(prompt)

    def sampling_params(self, base: SamplingParams) -> SamplingParams:
        words = [w for w in self.syntax.stop_words(sorted(self.tools)) if w not in base.stop_words]
        return base.replace(stop_words=[*base.stop_words, *words]) if words else base

    async def step(self, turn: list[int]) -> EnvStep:
        ids = [int(i) for i in turn]
        end = next((k for k, i in enumerate(ids) if i in self.eos_ids), None)
        text = self.tokenizer.decode(ids if end is None else ids[:end], skip_special_tokens=False)
        try:
            call = self.syntax.parse(text)
        except ToolError as e:
            return self._observe(self.error_format.format(error=e), error=True)
        if call is None:  # the final answer
            stopped = end is not None or not self.require_stop
            value = float(self.reward(self.example, text)) if stopped else 0.0
            return EnvStep(reward=value, done=True, info={"tool_calls": 0.0, "tool_errors": 0.0})
        try:
            result = await self._call(call)
        except Exception as e:  # the tool's failure is the model's observation
            error = str(e) if isinstance(e, ToolError) else f"{type(e).__name__}: {e}"
            return self._observe(self.error_format.format(error=error), error=True)
        return self._observe(self.result_format.format(result=result), error=False)

    async def _call(self, call: ToolCall) -> str:
        self.calls += 1
        if self.calls > self.max_tool_calls:
            raise ToolError(f"tool call limit reached ({self.max_tool_calls} per episode)")
        fn = self.tools.get(call.name)
        if fn is None:
            raise ToolError(f"unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}")
        return await run_tool(fn, call.args, self.timeout_s)

    def _observe(self, text: str, error: bool) -> EnvStep:
        text = text[: self.max_observation_chars]
        info = {"tool_calls": 1.0, "tool_errors": float(error)}
        return EnvStep(observation=self.tokenizer.encode(text, add_bos=False), info=info)


def _check_tools(tools: Mapping[str, ToolFn]) -> dict[str, ToolFn]:
    if not isinstance(tools, Mapping) or not tools:
        raise ValueError(f"tools must be a non-empty mapping name -> callable, got {tools!r:.200}")
    for name, fn in tools.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"tool name {name!r} must match {_NAME.pattern}")
        if not callable(fn):
            raise ValueError(f"tool {name!r} is not callable: {fn!r:.200}")
    return dict(tools)


def _check_positive(name: str, value: Any, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        kind = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {kind} > 0, got {value!r}")
