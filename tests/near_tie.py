"""Greedy tokens of two different computations in default mode (batched vs alone, cluster vs one
engine, static vs eager decode, another attention kernel) agree only up to the first near tie.

Their floats differ by GEMM shape and batch composition (~1e-6 in fp32), so a greedy pick whose
runner-up is that close may flip on another CPU, and everything after it may differ (issue 28).
Exact equality of every token is the batch-invariant mode's promise
(tests/test_batch_invariant_engine.py); these helpers compare what default mode pins down: the
tokens before the first pick within CLEAR_MARGIN of its runner-up (all of them when there is none).
`same_bits` is the batch-invariant comparison: every token and every log-prob bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout.request import DynamicInferenceRequest

CLEAR_MARGIN = 1e-3  # a greedy pick this far ahead of the runner-up survives 1e-6 path noise


def tie_free_prefix(top_n: Sequence[dict[int, float]]) -> int:
    """How many leading greedy tokens `top_n` (each token's top-2 or more log-probs) pins down."""
    for i, top in enumerate(top_n):
        first, second = sorted(top.values(), reverse=True)[:2]
        if first - second < CLEAR_MARGIN:
            return i
    return len(top_n)


def agreeing_prefix(a: DynamicInferenceRequest, b: DynamicInferenceRequest) -> int:
    """How many leading tokens two greedy runs (both with top_n_logprobs >= 2) must agree on."""
    return min(
        tie_free_prefix(a.generated_top_n_logprobs), tie_free_prefix(b.generated_top_n_logprobs)
    )


def greedy_agrees(got: Sequence[int], want: DynamicInferenceRequest, n: int | None = None) -> bool:
    """`got`, greedy tokens of another computation, are the first `n` (default: all) of `want`'s
    (a run with top_n_logprobs >= 2), compared up to want's first near tie."""
    n = len(want.generated_tokens) if n is None else n
    k = min(n, tie_free_prefix(want.generated_top_n_logprobs))
    if k == n:
        return list(got) == list(want.generated_tokens[:n])
    return list(got[:k]) == list(want.generated_tokens[:k])  # what follows a near tie may differ


def assert_greedy_agrees(
    got: Sequence[Sequence[int]], want: Sequence[DynamicInferenceRequest]
) -> None:
    """Each `got[i]` agrees with `want[i]` (`greedy_agrees`)."""
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert greedy_agrees(g, w), (i, list(g), w.generated_tokens)


def top2_rows(logp: torch.Tensor) -> list[dict[int, float]]:
    """Each row's two best log-probs as {token id: log-prob}: a reference forward's margins."""
    vals, ids = logp.topk(2, dim=-1)
    return [dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, vals, strict=True)]


def assert_matches_reference(
    got: Sequence[int], want: Sequence[int], want_top2: Sequence[dict[int, float]]
) -> int:
    """`got` equals a reference's greedy tokens `want` up to the reference's first near tie
    (`want_top2`: its top-2 log-probs per token), all of them when it has none. Returns how many
    leading tokens agree, the span over which to compare their log-probs."""
    n = tie_free_prefix(want_top2)
    if n == len(want):
        assert list(got) == list(want), (list(got), list(want))
    else:
        assert list(got[:n]) == list(want[:n]), (n, list(got), list(want))
    return n


def same_bits(a: DynamicInferenceRequest, b: DynamicInferenceRequest) -> bool:
    """The same tokens and log-prob floats bit for bit (what batch-invariant mode promises two
    computations of one request, greedy or seeded)."""
    return list(a.generated_tokens) == list(b.generated_tokens) and torch.equal(
        torch.tensor(a.generated_log_probs, dtype=torch.float32),
        torch.tensor(b.generated_log_probs, dtype=torch.float32),
    )
