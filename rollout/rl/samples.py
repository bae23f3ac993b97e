"""`Sample`: one finished completion as a trainer sees it, and `collate` to batch them.

A sample is cut from a merged request record when it is handed to the trainer. Staleness is
counted in weight updates and is relative to the manager's weights at that moment; it is
computed by `rollout.rl.staleness.completion_staleness` (definitions: docs/internals.md,
"Staleness").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from rollout.request import DynamicInferenceEventType, DynamicInferenceRequest

if TYPE_CHECKING:
    from rollout.rl.staleness import CompletionStaleness


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
    kv_versions: list[int]  # weight version that computed each completion token's KV
    weight_versions: list[int]  # sorted unique versions the completion spans
    finish_reason: str | None
    num_evictions: int = 0
    reward: Any = None
    metadata: Any = None  # whatever came with the prompt (a dict item's other keys)
    failed: bool = False
    error: str | None = None  # why it failed (the record's last error event)
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


def sample_from_request(
    req: DynamicInferenceRequest,
    group_id: int,
    index: int,
    metadata: Any,
    staleness: CompletionStaleness,
) -> Sample:
    """Cut a Sample from a merged (checkpoint-free) request and its per-token staleness."""
    prompt = [] if req.prompt_tokens is None else req.prompt_tokens.tolist()
    evictions = sum(e.type == DynamicInferenceEventType.EVICT for e in req.events)
    failed = req.failed()
    return Sample(
        group_id=group_id,
        index=index,
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_tokens=prompt,
        completion_tokens=list(req.generated_tokens),
        completion_text=req.generated_text,
        logprobs=list(req.generated_log_probs),
        policy_staleness=staleness.policy,
        kv_staleness=staleness.kv,
        token_versions=staleness.token_versions,
        kv_versions=staleness.kv_versions,
        weight_versions=req.weight_versions,
        finish_reason="failed" if failed else req.stop_reason,
        num_evictions=evictions,
        metadata=metadata,
        failed=failed,
        error=request_error(req) if failed else None,
        token_times=_token_times(req),
    )


def request_error(req: DynamicInferenceRequest) -> str:
    """The last error event's "type: message", or why the record counts as failed."""
    for e in reversed(req.events):
        if isinstance(e.payload, dict) and "message" in e.payload:
            return f"{e.payload.get('type', 'Error')}: {e.payload['message']}"
    return f"request failed (status {req.status.name})"


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
