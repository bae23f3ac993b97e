"""`Environment`: the other side of a multi-turn episode, in token ids.

An episode is one growing token list. The environment starts it (`reset` returns the prompt's
token ids) and answers each model turn (`step` gets the turn's generated ids and returns the
observation ids to append, a reward and whether the episode is done). Nothing already in the
episode is ever re-tokenized or re-templated: the trainer sees exactly the tokens the policy
sampled, and the observation tokens the environment chose (loss mask 0).

Both methods are coroutines: while one episode waits on a slow tool, the others generate. They
run on the manager's environment thread (one asyncio loop), so blocking work belongs in
`asyncio.to_thread`. An exception from either fails its episode alone (counted, logged); the
batch and the engine go on.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

from rollout.sampling import SamplingParams

__all__ = ["EnvFactory", "EnvStep", "Environment"]


@dataclasses.dataclass
class EnvStep:
    """The environment's answer to one model turn.

    `observation`: token ids appended after the turn (loss mask 0; [] for none). `reward` is
    added to the episode's reward. `info` holds per-turn counts that the manager sums into the
    episode's metrics (for example {"tool_calls": 1, "tool_errors": 0}).
    """

    observation: list[int] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """One episode's environment; a fresh instance per episode (`EnvFactory`)."""

    @abc.abstractmethod
    async def reset(self, example: Any) -> list[int]:
        """The episode's prompt as token ids (the prompt-source item is `example`)."""

    @abc.abstractmethod
    async def step(self, turn: list[int]) -> EnvStep:
        """Answer the model's turn (its generated ids, stop token included when it stopped on one)."""

    def sampling_params(self, base: SamplingParams) -> SamplingParams:
        """The sampling parameters of every model turn (default: the caller's). A tool
        environment adds the stop words that end a call, so a turn ends where a tool runs."""
        return base

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the episode held (called once, also when the episode failed)."""


EnvFactory = Callable[[Any], Environment]
