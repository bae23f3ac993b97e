"""`Sample`: one finished completion as a trainer sees it, and `collate` to batch them.

A sample is cut from a merged request record. Staleness is counted in weight updates and is
relative to the weights current when the sample is handed to the trainer: the engine's counters
at finish time plus the updates that happened while the sample waited in a queue (async mode).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from rollout.request import DynamicInferenceEventType, DynamicInferenceRequest


@dataclasses.dataclass
class Sample:
    group_id: int
    index: int  # position inside its GRPO group (0..n-1)
    request_id: int
    prompt: str | None
    prompt_tokens: list[int]
    completion_tokens: list[int]
    completion_text: str | None
    logprobs: list[float]  # behaviour log-prob of each completion token
    policy_staleness: list[int]  # per completion token: updates since it was sampled
    kv_staleness: list[int]  # per completion token: updates since its KV was computed
    token_versions: list[int]  # weight version that sampled each completion token
    weight_versions: list[int]  # sorted unique versions the completion spans
    finish_reason: str | None
    num_evictions: int = 0
    reward: Any = None
    metadata: Any = None  # whatever came with the prompt (a dict item's other keys)
    failed: bool = False
    token_times: list[float] = dataclasses.field(default_factory=list, repr=False)  # wall clock

    @property
    def max_policy_staleness(self) -> int:
        return max(self.policy_staleness, default=0)

    @property
    def max_kv_staleness(self) -> int:
        return max(self.kv_staleness, default=0)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.completion_tokens)

    def age(self, updates: int) -> None:
        """`updates` more weight updates happened since the counters were taken."""
        if updates:
            self.policy_staleness = [s + updates for s in self.policy_staleness]
            self.kv_staleness = [s + updates for s in self.kv_staleness]


def _completion_counts(t: torch.Tensor | None, start: int, n: int) -> list[int]:
    if t is None:
        return [0] * n
    vals = t[start : start + n].tolist()
    return vals + [0] * (n - len(vals))  # positions the engine never tracked saw no update


def sample_from_request(
    req: DynamicInferenceRequest, group_id: int, index: int, metadata: Any = None
) -> Sample:
    """Cut a Sample from a merged (checkpoint-free) request."""
    prompt = [] if req.prompt_tokens is None else req.prompt_tokens.tolist()
    gen = list(req.generated_tokens)
    start, n = len(prompt), len(gen)
    evictions = sum(e.type == DynamicInferenceEventType.EVICT for e in req.events)
    return Sample(
        group_id=group_id,
        index=index,
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_tokens=prompt,
        completion_tokens=gen,
        completion_text=req.generated_text,
        logprobs=list(req.generated_log_probs),
        policy_staleness=_completion_counts(req.policy_staleness, start, n),
        kv_staleness=_completion_counts(req.kv_cache_staleness, start, n),
        token_versions=list(req.generated_weight_versions),
        weight_versions=req.weight_versions,
        finish_reason="failed" if req.failed() else req.stop_reason,
        num_evictions=evictions,
        metadata=metadata,
        failed=req.failed(),
        token_times=_token_times(req),
    )


def _token_times(req: DynamicInferenceRequest) -> list[float]:
    """When each completion token was sampled: arrival + ttft, then the tpot gaps."""
    if req.ttft is None or req.arrival_time is None:
        return []
    t = req.arrival_time + req.ttft
    out = [t]
    for gap in req.tpot:
        t += gap
        out.append(t)
    return out[: len(req.generated_tokens)]


def collate(samples: Sequence[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] tensors over prompt + completion, aligned with the tokens.

    Per-token values (behaviour log-prob, staleness) sit at the completion token's own position,
    which is what `trainer_hooks.losses.sequence_log_probs` produces from the trainer's logits.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    for s in samples:
        if len(s.logprobs) != len(s.completion_tokens):
            raise ValueError(
                f"sample {s.request_id}: {len(s.logprobs)} log-probs for "
                f"{len(s.completion_tokens)} tokens (sampling_params.return_log_probs=False?)"
            )
    B, T = len(samples), max(s.num_tokens for s in samples)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.bool)
    completion = torch.zeros(B, T, dtype=torch.bool)
    logp = torch.zeros(B, T, dtype=torch.float32)
    pol = torch.zeros(B, T, dtype=torch.int32)
    kv = torch.zeros(B, T, dtype=torch.int32)
    for i, s in enumerate(samples):
        p, n = len(s.prompt_tokens), len(s.completion_tokens)
        tokens[i, : p + n] = torch.tensor(s.prompt_tokens + s.completion_tokens, dtype=torch.long)
        attention[i, : p + n] = True
        completion[i, p : p + n] = True
        logp[i, p : p + n] = torch.tensor(s.logprobs, dtype=torch.float32)
        pol[i, p : p + n] = torch.tensor(s.policy_staleness, dtype=torch.int32)
        kv[i, p : p + n] = torch.tensor(s.kv_staleness, dtype=torch.int32)
    out = {
        "tokens": tokens,
        "attention_mask": attention,
        "completion_mask": completion,
        "behaviour_logp": logp,
        "policy_staleness": pol,
        "kv_staleness": kv,
        "group_ids": torch.tensor([s.group_id for s in samples], dtype=torch.long),
        "prompt_lengths": torch.tensor([len(s.prompt_tokens) for s in samples], dtype=torch.long),
    }
    rewards = [s.reward for s in samples]
    if all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
        out["rewards"] = torch.tensor(rewards, dtype=torch.float32)
    return out
