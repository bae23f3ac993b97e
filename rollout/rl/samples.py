"""`Sample`: one finished completion or episode as a trainer sees it, and `collate` to batch them.

A sample is cut from a merged request record (or a multi-turn episode's records,
`rollout.rl.episodes`) when it is handed to the trainer. Staleness is counted in weight updates
and is relative to the manager's weights at that moment; it is computed by
`rollout.rl.staleness.completion_staleness` (definitions: docs/internals.md, "Staleness").

An episode's completion interleaves model turns and observations: `loss_mask` is 1 on the tokens
the policy sampled and 0 on the observation tokens, whose log-prob, staleness and versions are
placeholders (0, 0, NO_VERSION). `collate` folds the mask into `completion_mask`, so the losses
train model tokens only, exactly as for single-turn samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from rollout.request import DynamicInferenceEventType, DynamicInferenceRequest
from rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from rollout.rl.staleness import CompletionStaleness


NO_VERSION = -1  # the version of an observation token: no policy sampled it


@dataclasses.dataclass
class Turn:
    """One model turn of an episode, located in the episode's completion tokens."""

    start: int  # offset of the turn's first token in `Sample.completion_tokens`
    num_tokens: int  # tokens the model generated in this turn
    num_observation_tokens: int  # tokens the environment appended after it
    context_tokens: int  # episode tokens before the turn (its prompt)
    cached_tokens: int  # of those, KV reused from the prefix cache instead of computed
    reward: float
    finish_reason: str | None  # why the model's turn stopped (stop token, length, ...)
    weight_versions: list[int]  # sorted unique versions that sampled the turn
    max_policy_staleness: int = 0
    max_kv_staleness: int = 0

    @property
    def computed_tokens(self) -> int:
        """Context tokens the engine had to compute for this turn (prefill)."""
        return self.context_tokens - self.cached_tokens


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
    loss_mask: list[int] | None = None  # per completion token; None: every token is the model's
    turns: list[Turn] = dataclasses.field(default_factory=list)  # episodes only
    env_info: dict[str, float] = dataclasses.field(default_factory=dict)  # summed EnvStep.info
    # routing replay (docs/internals.md): [completion tokens, moe_layers, k], row i the experts
    # of the forward that sampled completion token i; the prompt's [prompt tokens - 1, ...]
    routed_experts: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    prompt_routed_experts: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    # what the completion was sampled with, seed included (`rollout.rl.replay` regenerates it)
    sampling_params: SamplingParams | None = dataclasses.field(default=None, repr=False)

    @property
    def is_episode(self) -> bool:
        return bool(self.turns) or self.loss_mask is not None

    def on_model_tokens(self, values: list[Any]) -> list[Any]:
        """`values` (one per completion token) at the tokens the policy sampled: an episode's
        observation tokens carry placeholders that must not enter statistics."""
        if self.loss_mask is None:
            return values
        return [v for v, bit in zip(values, self.loss_mask, strict=True) if bit]

    @property
    def num_model_tokens(self) -> int:
        """Completion tokens the policy sampled (observation tokens excluded)."""
        return len(self.completion_tokens) if self.loss_mask is None else sum(self.loss_mask)

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
    evictions = num_evictions(req)
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
        routed_experts=torch.stack(req.routed_experts) if req.routed_experts else None,
        prompt_routed_experts=req.prompt_routed_experts,
        sampling_params=req.sampling_params,
    )


def num_evictions(req: DynamicInferenceRequest) -> int:
    """How often the engine evicted the request (its KV dropped for lack of blocks)."""
    return sum(e.type == DynamicInferenceEventType.EVICT for e in req.events)


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

    `completion_mask` marks the tokens the policy sampled: the whole completion of a single-turn
    sample, an episode's model turns only (its `loss_mask`), so every loss trains them alone.
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
        if s.loss_mask is not None and len(s.loss_mask) != len(s.completion_tokens):
            raise ValueError(
                f"sample {s.request_id}: loss_mask has {len(s.loss_mask)} entries for "
                f"{len(s.completion_tokens)} completion tokens"
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
        completion[i, p : p + n] = (
            True if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.bool)
        )
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
    routed = collate_routed_experts(samples, T)
    if routed is not None:
        out["routed_experts"], out["routed_experts_mask"] = routed
    rewards = [s.reward for s in samples]
    if all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
        out["rewards"] = torch.tensor(rewards, dtype=torch.float32)
    return out


def collate_routed_experts(
    samples: Sequence[Sample], T: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[B, T, moe_layers, k] experts by input position (position p: the experts token p was
    routed to, which shaped the logits at p that score token p + 1) and a [B, T] mask of the
    positions recorded; None when no sample carries routing. Unrecorded positions (a
    prefix-cache hit's prompt, padding, the last token) are routed by the trainer itself."""
    have = [s for s in samples if s.routed_experts is not None]
    if not have:
        return None
    layers, k = have[0].routed_experts.shape[1:]
    experts = torch.zeros(len(samples), T, layers, k, dtype=have[0].routed_experts.dtype)
    mask = torch.zeros(len(samples), T, dtype=torch.bool)
    for i, s in enumerate(samples):
        p, gen, prompt = len(s.prompt_tokens), s.routed_experts, s.prompt_routed_experts
        if gen is not None and len(gen) == len(s.completion_tokens) and p:
            experts[i, p - 1 : p - 1 + len(gen)] = gen
            mask[i, p - 1 : p - 1 + len(gen)] = True
        if gen is not None and prompt is not None and len(prompt) == p - 1:
            experts[i, : p - 1] = prompt
            mask[i, : p - 1] = True
    return experts, mask
