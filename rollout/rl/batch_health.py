"""A batch that is mostly failed samples is an error, not a return value.

A failed sample carries no learning signal (reward 0, no tokens or partial ones); a few are the
normal cost of bad prompts or a lost engine and come back flagged (`Sample.failed`). A batch in
which more than `max_failed_fraction` of the samples failed means something is broken (engines
gone, a bad sampling config, every environment crashing): training on it would silently turn the
step into noise, so `collect` raises `BatchFailed` naming the reasons instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rollout.rl.samples import Sample

MAX_REASONS = 3  # the most frequent failure reasons named in the error


class BatchFailed(RuntimeError):
    """Too many samples of a batch failed; `reasons` counts their errors."""

    def __init__(self, message: str, reasons: Counter[str]) -> None:
        super().__init__(message)
        self.reasons = reasons


def check_batch(batch: Sequence[Sample], max_failed_fraction: float) -> None:
    """Raise BatchFailed when more than `max_failed_fraction` of `batch` failed."""
    failed = [s for s in batch if s.failed]
    if not batch or len(failed) <= max_failed_fraction * len(batch):
        return
    reasons = Counter(s.error or "unknown" for s in failed)
    named = "; ".join(f"{n} x {why}" for why, n in reasons.most_common(MAX_REASONS))
    more = len(reasons) - MAX_REASONS
    raise BatchFailed(
        f"{len(failed)} of {len(batch)} samples in the batch failed (more than "
        f"max_failed_fraction={max_failed_fraction}): {named}"
        + (f"; and {more} other reason(s)" if more > 0 else ""),
        reasons,
    )
