"""Per-token staleness, computed when a sample is handed out.

A group's merged request records wait in the manager until the trainer takes them. Only then
(`rollout.rl.groups.hand_out`) are they cut into Samples whose per-token staleness is computed,
in one place (`completion_staleness`), from each token's own weight versions against the
manager's version history at that moment: no update count is taken when a record arrives, so it
does not matter how late a record reaches the manager (dp > 1, async) or how long it waits. The
definitions are in docs/internals.md ("Staleness").
"""

from __future__ import annotations

import bisect
import dataclasses

from rollout.request import DynamicInferenceRequest


class VersionHistory:
    """The manager's weight versions in the order it applied them: `initial`, then every version
    passed to update_weights. `updates_at(v)` is U(v), the number of updates applied up to and
    including v; staleness is counted in updates, so version jumps (7 -> 10) count as one."""

    def __init__(self, initial: int) -> None:
        self.versions = [int(initial)]

    def append(self, version: int) -> None:
        if version <= self.versions[-1]:
            raise ValueError(f"weight version must increase: {version} after {self.versions[-1]}")
        self.versions.append(int(version))

    @property
    def current(self) -> int:
        return self.versions[-1]

    @property
    def num_updates(self) -> int:
        return len(self.versions) - 1

    def updates_at(self, version: int) -> int:
        """U(version). A version the manager never applied counts as the last one before it."""
        return max(bisect.bisect_right(self.versions, version) - 1, 0)

    def version_at(self, updates: int) -> int:
        """The version current after `updates` updates (clamped to the history)."""
        return self.versions[min(max(updates, 0), len(self.versions) - 1)]


@dataclasses.dataclass
class CompletionStaleness:
    """Per completion token: sampling version, KV version, and their staleness as of hand-out."""

    token_versions: list[int]
    kv_versions: list[int]
    policy: list[int]
    kv: list[int]


def completion_staleness(
    req: DynamicInferenceRequest, history: VersionHistory
) -> CompletionStaleness:
    """The one place per-token staleness is computed (definitions: docs/internals.md).

    policy_i = U(now) - U(v_i), v_i = the version that sampled token i.
    kv_i = U(now) - U(k_i), k_i = the version that computed the KV held for token i's position
    when the request left its engine: U(k_i) = U(staleness_version) - kv counter i (the engine's
    per-position count of updates since that KV was computed). A record no engine stamped (none
    of its KV was ever kept) has k_i = v_i. KV is never older than its token (U(k_i) >= U(v_i)).
    """
    versions = list(req.generated_weight_versions)
    start, n = req.prompt_length, len(req.generated_tokens)
    if len(versions) != n:
        raise ValueError(
            f"request {req.request_id}: {len(versions)} weight versions for {n} generated tokens"
        )
    now = history.num_updates
    sampled = [history.updates_at(v) for v in versions]
    if req.staleness_version is None:
        computed = list(sampled)
    else:
        base = history.updates_at(req.staleness_version)
        counts = _counters(req, start, n)
        computed = [max(base - c, u) for c, u in zip(counts, sampled, strict=True)]
    return CompletionStaleness(
        token_versions=versions,
        kv_versions=[history.version_at(u) for u in computed],
        policy=[now - u for u in sampled],
        kv=[now - u for u in computed],
    )


def _counters(req: DynamicInferenceRequest, start: int, n: int) -> list[int]:
    """The engine's KV counters of the completion positions (positions never tracked: 0)."""
    t = req.kv_cache_staleness
    vals = [] if t is None else t[start : start + n].tolist()
    return vals + [0] * (n - len(vals))
