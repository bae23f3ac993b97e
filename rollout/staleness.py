"""Staleness of handed-out samples, counted in weight updates.

A `Group` (one prompt's n samples in flight) remembers the manager's update count when each
sample finished. At hand-out its samples are aged to now (`age_group`); `stale_indices` picks the
ones over `max_staleness` (the manager drops the whole group, since GRPO advantages need complete
groups, or regenerates just those samples); `staleness_stats` summarises a collected batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollout.samples import Sample
from rollout.sampling import SamplingParams


@dataclasses.dataclass
class Group:
    gid: int
    prompt: Any
    metadata: Any
    sampling_params: SamplingParams
    samples: list[Sample | None]
    finished_at: list[int]  # manager update count when each sample finished
    for_collect: bool = True

    @property
    def complete(self) -> bool:
        return all(s is not None for s in self.samples)


def age_group(g: Group, num_updates: int) -> list[Sample]:
    """Age every sample by the updates since it finished; the samples in index order."""
    for s, at in zip(g.samples, g.finished_at, strict=True):
        s.age(num_updates - at)
    return list(g.samples)


def stale_indices(samples: list[Sample], bound: int | None) -> list[int]:
    """Indices of samples whose per-token policy staleness exceeds `bound` (None: no bound)."""
    return [s.index for s in samples if bound is not None and s.max_policy_staleness > bound]


def staleness_stats(samples: list[Sample]) -> dict[str, float]:
    """`staleness/*` metrics over every token of a batch ({} for a batch without tokens)."""
    pol = [x for s in samples for x in s.policy_staleness]
    kv = [x for s in samples for x in s.kv_staleness]
    if not pol:
        return {}
    return {
        "staleness/policy_token_mean": sum(pol) / len(pol),
        "staleness/policy_max": max(pol),
        "staleness/kv_token_mean": sum(kv) / len(kv),
        "staleness/kv_max": max(kv),
        "staleness/versions_per_sample_max": max(len(s.weight_versions) for s in samples),
    }
