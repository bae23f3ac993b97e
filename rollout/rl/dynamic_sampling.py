"""Rewards and dynamic sampling (DAPO) over the groups of one batch: a group whose members all
earned the same reward carries no GRPO signal; it is dropped while the extra-group budget
lasts, then kept (counted) so a batch always has its size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.rl.groups import zero_variance
from rollout.rl.manager_config import RolloutManagerConfig
from rollout.rl.samples import Sample

RewardFn = Callable[[Sample], Any]


def assign_rewards(samples: list[Sample], reward_fn: RewardFn | None) -> None:
    if reward_fn is not None:
        for s in samples:
            s.reward = reward_fn(s)


class DynamicSampling:
    """One batch's dynamic-sampling decisions; counts into the manager's `counters`."""

    def __init__(self, config: RolloutManagerConfig, batch_groups: int, counters: dict) -> None:
        self.on = config.dynamic_sampling
        extra = config.max_extra_groups
        self.budget = batch_groups if extra is None else extra
        self.counters = counters
        self.kept = self.dropped = self.filled = 0

    def keep(self, samples: list[Sample]) -> bool:
        flat = zero_variance(samples)
        if self.on and flat and self.dropped < self.budget:
            self.dropped += 1
            self.counters["groups_dropped_zero_variance"] += 1
            self.counters["groups_oversampled"] += 1
            return False
        if self.on and flat:
            self.filled += 1
            self.counters["groups_filled_zero_variance"] += 1
        self.kept += 1
        self.counters["groups_out"] += 1
        self.counters["samples_out"] += len(samples)
        return True

    def metrics(self) -> dict[str, float]:
        if not self.on:
            return {}
        return {
            "rollout/dynamic_sampling/kept": self.kept - self.filled,
            "rollout/dynamic_sampling/dropped": self.dropped,
            "rollout/dynamic_sampling/oversampled": self.dropped,
            "rollout/dynamic_sampling/filled": self.filled,
        }
