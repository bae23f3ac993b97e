"""GRPO groups in the manager, and the filters applied when they are handed out.

A group holds one result per member: a merged request record (single turn) or an
`EpisodeRecord` (multi-turn). `hand_out` cuts them into Samples with staleness as of now.
Two filters decide whether a group reaches the trainer:

- `stale_indices`: the samples over `max_staleness` (the manager drops their whole group or
  regenerates just those samples);
- `zero_variance`: every member earned the same reward, so GRPO's advantages are all zero and
  the group carries no gradient. Dynamic sampling (DAPO) drops such groups and draws more
  prompts to keep the batch full.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollout.request import DynamicInferenceRequest
from rollout.rl.environment import EnvFactory
from rollout.rl.episodes import EpisodeRecord, episode_sample
from rollout.rl.samples import Sample, sample_from_request
from rollout.rl.staleness import VersionHistory, completion_staleness
from rollout.sampling import SamplingParams

Result = DynamicInferenceRequest | EpisodeRecord


@dataclasses.dataclass
class Group:
    """One GRPO group: the result of each member once it finished (None while in flight)."""

    gid: int
    prompt: Any  # the prompt (single turn) or the episode's example
    metadata: Any
    sampling_params: SamplingParams
    records: list[Result | None]
    for_collect: bool = True
    env: EnvFactory | None = None  # set: every member is an episode

    @property
    def complete(self) -> bool:
        return all(r is not None for r in self.records)


def hand_out(g: Group, history: VersionHistory) -> list[Sample]:
    """The group's samples, in index order, with staleness as of now."""
    return [_sample(r, g, i, history) for i, r in enumerate(g.records)]


def _sample(result: Result | None, g: Group, index: int, history: VersionHistory) -> Sample:
    if isinstance(result, EpisodeRecord):
        return episode_sample(result, g.gid, index, g.metadata, history)
    if result is None:
        raise ValueError(f"group {g.gid}: member {index} has not finished")
    return sample_from_request(result, g.gid, index, g.metadata, completion_staleness(result, history))  # fmt: skip


def stale_indices(samples: list[Sample], bound: int | None) -> list[int]:
    """Indices of samples holding a token (or KV) staler than `bound` (None: no bound)."""
    if bound is None:
        return []
    return [
        s.index for s in samples if s.max_policy_staleness > bound or s.max_kv_staleness > bound
    ]


def zero_variance(samples: list[Sample]) -> bool:
    """True when every sample of the group has the same numeric reward (no GRPO signal)."""
    rewards = [s.reward for s in samples]
    if not rewards or not all(isinstance(r, (int, float)) for r in rewards):
        return False
    return max(rewards) - min(rewards) <= 1e-12
