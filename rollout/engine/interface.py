"""The one engine contract: what the RolloutManager, the engine worker and `LLM` drive.

Three classes implement it: `DynamicInferenceEngine` (computes in this process),
`serving.cluster_engine.ClusterEngine` (N engine processes behind a coordinator: `step()` waits
for their records instead of computing) and the fake engine of the coordinator tests. Callers
use these methods and attributes only, never `getattr` probes: a method one implementation has
no use for is a cheap no-op there (`wake` in-process, `pop_evicted_hashes` over a cluster).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rollout.request import DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams


class EngineLost(RuntimeError):
    """The engine is gone for good (a cluster's coordinator died): nothing in flight will
    finish and nothing new can start, so callers stop instead of failing request by request."""


@dataclass
class StepOutput:
    """What one step produced: finished records and streaming partials
    `(request_id, new_tokens, new_log_probs, new_weight_versions, new_top_n_logprobs,
    routed_experts)` (log-probs and top-n empty unless requested; the versions let another
    engine resume the request with exact staleness; routed_experts: routing replay's rows or
    None, rollout.engine.sequence.take_partial)."""

    finished: list[DynamicInferenceRequestRecord] = field(default_factory=list)
    partials: list[tuple] = field(default_factory=list)


@runtime_checkable
class EngineProtocol(Protocol):
    """An inference engine driven one `step()` at a time by a single thread."""

    weight_version: int  # the weights new tokens are sampled with
    tokenizer: Any  # text prompts are tokenized with it (None: token-id prompts only)
    model: Any  # the torch module it computes with; None where the weights live elsewhere

    def add_request(
        self,
        request_id: int,
        prompt: Any = None,
        sampling_params: SamplingParams | None = None,
        record: DynamicInferenceRequestRecord | None = None,
        precomputed_block_hashes: Sequence[int] | None = None,
        routing_key: str | None = None,
    ) -> Any:
        """Queue a request (text or token ids), or resume `record` (a checkpoint from another
        engine); `precomputed_block_hashes` (this engine's block size) spare hashing the prompt.
        `routing_key`: requests with one key run on one engine while it lives (an episode's
        turns, whose KV it holds); one engine has nothing to choose and ignores it.
        A request that can never run comes out of a later step as FAILED; a malformed call (an
        id already in the engine, a bad `record`) raises ValueError. The return value is the
        implementation's own (in-process: the live record): callers key on `request_id`."""
        ...

    def step(self) -> StepOutput:
        """Advance every running request by one token (or wait for other processes to)."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def abort(self, request_id: int) -> bool:
        """Stop a request; its record (stop_reason "abort") comes out of a later step.
        False when the engine does not hold it."""
        ...

    def discard(self, request_id: int) -> None:
        """Forget a request and free its memory; no record will come out."""
        ...

    def wake(self) -> None:
        """Return a blocked `step()` early (work arrived from another thread); thread-safe. A
        no-op where `step()` never blocks (in-process)."""
        ...

    def suspend(self, mode: str) -> int:
        """Free the KV memory ("persist", "offload" or "recompute"); returns bytes freed."""
        ...

    def resume(self) -> None:
        """Serve again: the KV pool back, and weights offloaded by release_weights."""
        ...

    def release_weights(self, mode: str) -> dict:
        """While suspended, free the weights too: "offload" (to host memory, back on resume) or
        "discard" (back with the next update_weights; nothing is computed until then).
        Returns {"weights": what happened, "weights_bytes_freed": bytes the device got back}."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap to new weights (all-or-nothing) and account staleness of in-flight requests."""
        ...

    def load(self) -> dict[str, Any]:
        """Queue depth and KV usage, for routing."""
        ...

    def pop_evicted_hashes(self) -> list[int]:
        """Prefix-cache block hashes dropped since the last call (the router forgets them)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for logging (a flat dict of numbers and short strings)."""
        ...

    def close(self) -> None:
        """Release processes and memory; the engine is unusable afterwards. Idempotent."""
        ...
