"""Synthetic RL tasks that a tiny byte-level model trained from scratch can learn on CPU.

- "reverse": "123>" -> "321" (reverse a digit string of length min_len..max_len);
- "add":     "12+34=" -> "46" (sum of two numbers with 1..max_digits digits).

Each task samples prompts from a caller-owned `random.Random` (deterministic under a seed),
scores completions with partial credit, and builds a supervised warm-start batch from a
demonstrator's answers. The demonstrator can be imperfect (`ReverseTask(demo_accuracy=0.3)`: it
reverses 30% of the strings and copies the rest unreversed), so imitation alone decodes the
demonstrator's majority mistake greedily and only the verifiable reward can teach the task. The reward is
shaped so that GRPO has a gradient from the first step: a completion earns credit for every
correct leading character, counted over the whole answer (stopping early leaves the missing
characters uncredited, exactly like wrong ones), the full 1.0 only for the exact answer followed by
a stop, and loses a little for anything past the answer or not stopping. Completions are scored
with their special tokens spelled out (`<pad>`, `<bos>`): a token the model emitted is never
invisible to the reward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

import torch

PREFIX_WEIGHT = 0.8  # share of the reward for the correct leading characters (exact = 1.0)
OVERRUN_PENALTY = 0.1  # extra characters after the answer, or no stop token at all


@dataclass(frozen=True)
class TaskExample:
    prompt: str
    answer: str


class Tokenizer(Protocol):
    bos_id: int | None  # None: the model's sequences start without one (Qwen2.5, Qwen3)
    eos_id: int
    pad_id: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def score(completion: str, answer: str, stopped: bool = True) -> float:
    """Partial-credit reward in [0, 1].

    1.0 iff completion == answer and generation stopped. Otherwise PREFIX_WEIGHT * (correct
    leading characters / len(answer)): the denominator is the full answer, so characters a short
    completion never produced count as wrong. Characters past the answer earn nothing and cost
    OVERRUN_PENALTY, as does never stopping; floored at 0.
    """
    if completion == answer and stopped:
        return 1.0
    good = 0
    for c, a in zip(completion, answer, strict=False):
        if c != a:
            break
        good += 1
    value = PREFIX_WEIGHT * good / max(1, len(answer))
    if len(completion) > len(answer) or not stopped:
        value -= OVERRUN_PENALTY
    return max(0.0, value)


class Task:
    """Base: subclasses define `name`, `make_example(rng)` and the length bounds."""

    name = "task"
    max_prompt_chars = 0
    max_answer_chars = 0

    def make_example(self, rng: random.Random) -> TaskExample:
        raise NotImplementedError

    def demonstration(self, example: TaskExample, rng: random.Random) -> str:
        """The warm start's target for `example`: the answer (a perfect demonstrator)."""
        return example.answer

    def demonstration_tokens(
        self, example: TaskExample, rng: random.Random, tokenizer: Tokenizer
    ) -> tuple[list[int], list[bool]]:
        """What the warm start appends to the prompt, as ids, and which of them it trains: here
        the demonstration and eos, all trained (a multi-turn task leaves its observations out)."""
        ids = [*tokenizer.encode(self.demonstration(example, rng), add_bos=False), tokenizer.eos_id]
        return ids, [True] * len(ids)

    def env_factory(self, tokenizer: Tokenizer) -> Any:
        """The multi-turn episodes' `EnvFactory` (`rollout.rl.environment`); None: single-turn."""
        return None

    # -- sampling ---------------------------------------------------------------------------------
    def sample_prompts(self, n: int, rng: random.Random | int) -> list[TaskExample]:
        """n examples drawn from `rng` (a `random.Random`, or an int seed)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        rng = _as_rng(rng)
        return [self.make_example(rng) for _ in range(n)]

    # -- rewards ----------------------------------------------------------------------------------
    def reward(self, completion_text: str, example: TaskExample, stopped: bool = True) -> float:
        """Reward of a decoded completion (stop token excluded); `stopped`=False if cut off."""
        return score(completion_text, example.answer, stopped)

    def reward_tokens(
        self, completion_ids: list[int], example: TaskExample, tokenizer: Tokenizer
    ) -> float:
        """Reward straight from generated ids: text up to the first eos (any of `eos_ids`),
        stopped iff one is present. Special tokens are decoded as text (`<pad>`, ...), not
        skipped: padding after the answer or a `<bos>` inside it must cost, not vanish."""
        ids = [int(i) for i in completion_ids]
        stops = set(getattr(tokenizer, "eos_ids", None) or [tokenizer.eos_id])
        end = next((k for k, i in enumerate(ids) if i in stops), None)
        if end is not None:
            ids = ids[:end]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        return self.reward(text, example, stopped=end is not None)

    # -- token budgets ----------------------------------------------------------------------------
    @property
    def max_prompt_tokens(self) -> int:
        """Upper bound on prompt length in tokens (bos if any + one per ASCII character)."""
        return 1 + self.max_prompt_chars

    @property
    def max_new_tokens(self) -> int:
        """Enough generation budget for the longest answer plus its eos."""
        return self.max_answer_chars + 1

    def prompt_ids(self, example: TaskExample, tokenizer: Tokenizer) -> list[int]:
        """bos (when the tokenizer has one: Qwen2.5/Qwen3 have none) + the prompt's ids."""
        return tokenizer.encode(example.prompt, add_bos=tokenizer.bos_id is not None)

    # -- supervised warm start --------------------------------------------------------------------
    def supervised_batch(
        self, n: int, rng: random.Random | int, tokenizer: Tokenizer
    ) -> dict[str, torch.Tensor]:
        """Teacher-forcing batch: bos + prompt + demonstration + eos, right-padded with pad_id.

        Returns `tokens` [n, T] int64, `loss_mask` [n, T] bool (True on the demonstration tokens
        and the eos, `demonstration_tokens`: the positions whose token the model must predict),
        `prompt_lens` [n]. The
        mask lines up with `trainer_hooks.losses.sequence_log_probs(logits, tokens, loss_mask)`.
        """
        rng = _as_rng(rng)
        seqs, masks, plens = [], [], []
        for ex in self.sample_prompts(n, rng):
            p = self.prompt_ids(ex, tokenizer)
            a, trained = self.demonstration_tokens(ex, rng, tokenizer)
            seqs.append(p + a)
            masks.append([False] * len(p) + trained)
            plens.append(len(p))
        width = max((len(s) for s in seqs), default=0)
        tokens = torch.full((n, width), tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.bool)
        for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
        return {"tokens": tokens, "loss_mask": mask, "prompt_lens": torch.tensor(plens)}


class ReverseTask(Task):
    """Reverse a digit string: "1234>" -> "4321".

    demo_accuracy: the share of warm-start demonstrations that reverse; the others copy the digits
    in prompt order, the demonstrator's one systematic mistake (1.0: a perfect demonstrator).
    """

    name = "reverse"

    def __init__(self, min_len: int = 2, max_len: int = 5, demo_accuracy: float = 1.0) -> None:
        _check_int("min_len", min_len, 1)
        _check_int("max_len", max_len, 1)
        if max_len < min_len:
            raise ValueError(f"reverse: max_len ({max_len}) must be >= min_len ({min_len})")
        if isinstance(demo_accuracy, bool) or not isinstance(demo_accuracy, (int, float)):
            raise ValueError(f"demo_accuracy must be a number in [0, 1], got {demo_accuracy!r}")
        if not 0.0 <= demo_accuracy <= 1.0:
            raise ValueError(f"demo_accuracy must be in [0, 1], got {demo_accuracy!r}")
        self.min_len, self.max_len = min_len, max_len
        self.demo_accuracy = float(demo_accuracy)
        self.max_prompt_chars = max_len + 1
        self.max_answer_chars = max_len

    def make_example(self, rng: random.Random) -> TaskExample:
        digits = "".join(
            rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len))
        )
        return TaskExample(prompt=f"{digits}>", answer=digits[::-1])

    def demonstration(self, example: TaskExample, rng: random.Random) -> str:
        """The answer with probability demo_accuracy, else the digits unreversed."""
        if self.demo_accuracy >= 1.0 or rng.random() < self.demo_accuracy:
            return example.answer
        return example.prompt[:-1]


class AddTask(Task):
    """Add two non-negative integers with 1..max_digits digits: "12+34=" -> "46"."""

    name = "add"

    def __init__(self, max_digits: int = 2) -> None:
        _check_int("max_digits", max_digits, 1)
        self.max_digits = max_digits
        self.max_prompt_chars = 2 * max_digits + 2
        self.max_answer_chars = max_digits + 1

    def make_example(self, rng: random.Random) -> TaskExample:
        a, b = (number_with(rng, rng.randint(1, self.max_digits)) for _ in range(2))
        return TaskExample(prompt=f"{a}+{b}=", answer=str(a + b))


def number_with(rng: random.Random, digits: int) -> int:
    """A uniform non-negative integer with exactly `digits` digits (0 counts as one digit)."""
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


TASKS: dict[str, type[Task]] = {"reverse": ReverseTask, "add": AddTask}


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a registered task by name; unknown names or arguments raise ValueError."""
    return task_from(TASKS, name, kwargs)


def task_from(registry: dict[str, type[Task]], name: str, kwargs: dict[str, Any]) -> Task:
    """`registry[name](**kwargs)`; unknown names or arguments raise ValueError."""
    if name not in registry:
        raise ValueError(f"unknown task {name!r}; available: {sorted(registry)}")
    try:
        return registry[name](**kwargs)
    except TypeError as e:  # unexpected keyword
        raise ValueError(f"bad arguments for task {name!r}: {e}") from e


def _as_rng(rng: random.Random | int) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, int) and not isinstance(rng, bool):
        return random.Random(rng)
    raise ValueError(f"rng must be a random.Random or an int seed, got {type(rng).__name__}")


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
