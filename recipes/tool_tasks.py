"""Tool-using tasks: multi-turn episodes in which the model calls a Python tool.

- "calculator": "4821*37=" -> the model writes "<calc>4821*37</calc>", the environment answers
  "178377\\n", the model copies it and stops: two model turns. A tiny byte-level model cannot
  multiply a 3-4 digit number by a 2-digit one, but it can copy operands into a call and a result
  out of it.

The warm start imitates an imperfect demonstrator (`demo_tool_rate`): it calls the calculator on
30% of the prompts and otherwise guesses directly, always the same way (the first operand with a
zero per digit of the second: an order of magnitude, rarely right). The guess is one learnable
habit that imitation makes the majority, so greedy decoding starts by guessing, near 0 exact
answers, and only the verifiable reward can make the tool call the policy. The warm start trains
the call, the answer and the eos; the calculator's observation between them is loss-masked, as in
RL. Rewards are `recipes.tasks.score` on the final answer (exact answer 1.0, partial credit for
correct leading digits).
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

from recipes.tasks import Task, TaskExample, Tokenizer, _check_int, number_with, task_from
from rollout.rl.environment import EnvFactory
from rollout.rl.tools import ToolCallSyntax, ToolEnvironment

MAX_RESULT_DIGITS = 30  # the calculator refuses results longer than this (an exponent bomb)
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculator(expression: str) -> str:
    """Integer arithmetic (+ - * // %, parentheses, unary minus) on `expression`: the tool.

    Anything else raises ValueError naming what it met (the model sees it as "error: ...")."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expression!r:.80}") from e
    return str(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        value = _OPS[type(node.op)](left, right)
        if len(str(abs(value))) > MAX_RESULT_DIGITS:
            raise ValueError(f"result longer than {MAX_RESULT_DIGITS} digits")
        return value
    raise ValueError(f"unsupported: {ast.unparse(node)!r:.80}")


class CalculatorTask(Task):
    """Multiply a min_digits..max_digits number by a multiplier_digits one: "4821*37=" -> "178377",
    with the `calc` tool (`ToolEnvironment`, call syntax `<calc>...</calc>`).

    demo_tool_rate: the share of warm-start demonstrations that call the calculator; the others
    guess directly (1.0: a perfect demonstrator).
    """

    name = "calculator"
    tool = "calc"
    syntax = ToolCallSyntax()  # <calc>...</calc>
    result_format = "{result}\n"

    def __init__(
        self,
        min_digits: int = 3,
        max_digits: int = 4,
        multiplier_digits: int = 2,
        demo_tool_rate: float = 1.0,
    ) -> None:
        _check_int("min_digits", min_digits, 1)
        _check_int("max_digits", max_digits, 1)
        _check_int("multiplier_digits", multiplier_digits, 1)
        if max_digits < min_digits:
            raise ValueError(f"calculator: max_digits ({max_digits}) must be >= min_digits ({min_digits})")  # fmt: skip
        if isinstance(demo_tool_rate, bool) or not isinstance(demo_tool_rate, (int, float)):
            raise ValueError(f"demo_tool_rate must be a number in [0, 1], got {demo_tool_rate!r}")
        if not 0.0 <= demo_tool_rate <= 1.0:
            raise ValueError(f"demo_tool_rate must be in [0, 1], got {demo_tool_rate!r}")
        self.min_digits, self.max_digits = min_digits, max_digits
        self.multiplier_digits = multiplier_digits
        self.demo_tool_rate = float(demo_tool_rate)
        self.max_prompt_chars = max_digits + multiplier_digits + 2
        self.max_answer_chars = max_digits + multiplier_digits

    def make_example(self, rng: random.Random) -> TaskExample:
        a = number_with(rng, rng.randint(self.min_digits, self.max_digits))
        b = number_with(rng, self.multiplier_digits)
        return TaskExample(prompt=f"{a}*{b}=", answer=str(a * b))

    # -- episodes ---------------------------------------------------------------------------------
    def call_text(self, example: TaskExample) -> str:
        """The model's first turn in a successful episode: the call on the prompt's operands."""
        start, end = (t.replace("{name}", self.tool) for t in (self.syntax.start, self.syntax.end))
        return f"{start}{example.prompt.removesuffix('=')}{end}"

    @property
    def max_new_tokens(self) -> int:
        """One turn's budget: the longest call (the answer turn is shorter)."""
        longest = TaskExample("9" * self.max_digits + "*" + "9" * self.multiplier_digits + "=", "")
        return len(self.call_text(longest))

    @property
    def max_episode_tokens(self) -> int:
        """A successful episode: prompt, call, result, answer and eos."""
        return self.max_prompt_tokens + self.max_new_tokens + 2 * (self.max_answer_chars + 1)

    def env_factory(self, tokenizer: Tokenizer) -> EnvFactory:
        """Episodes over prompt-source items {"prompt": ids, "example": TaskExample}."""
        return ToolEnvironment.factory(
            {self.tool: calculator}, tokenizer, prompt=lambda item: item["prompt"],
            reward=lambda item, answer: self.reward(answer, item["example"]),
            syntax=self.syntax, result_format=self.result_format,
        )  # fmt: skip

    # -- supervised warm start --------------------------------------------------------------------
    def demonstration(self, example: TaskExample, rng: random.Random) -> str:
        """The direct guess: the first operand with a zero per digit of the second."""
        a, b = example.prompt.removesuffix("=").split("*")
        return a + "0" * len(b)

    def demonstration_tokens(
        self, example: TaskExample, rng: random.Random, tokenizer: Tokenizer
    ) -> tuple[list[int], list[bool]]:
        """With probability demo_tool_rate the two-turn episode (call, result, answer, eos; the
        result untrained), else the direct guess and eos."""
        if self.demo_tool_rate < 1.0 and rng.random() >= self.demo_tool_rate:
            return super().demonstration_tokens(example, rng, tokenizer)
        call = tokenizer.encode(self.call_text(example), add_bos=False)
        result = self.result_format.format(result=calculator(example.prompt.removesuffix("=")))
        observation = tokenizer.encode(result, add_bos=False)
        answer = [*tokenizer.encode(example.answer, add_bos=False), tokenizer.eos_id]
        ids = call + observation + answer
        return ids, [True] * len(call) + [False] * len(observation) + [True] * len(answer)


TASKS: dict[str, type[Task]] = {"calculator": CalculatorTask}


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a registered tool task by name; unknown names or arguments raise ValueError."""
    return task_from(TASKS, name, kwargs)
