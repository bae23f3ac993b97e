"""Request-record builders shared by the record tests (behaviour and wire)."""

from __future__ import annotations

import torch

from rollout.request import DynamicInferenceEventType, DynamicInferenceRequest
from rollout.sampling import SamplingParams

ET = DynamicInferenceEventType


def make(tokens=(1, 2, 3, 4, 5), n=8, **kw) -> DynamicInferenceRequest:
    kw.setdefault("arrival_time", 100.0)
    return DynamicInferenceRequest(
        request_id=kw.pop("request_id", 7),
        prompt_tokens=list(tokens) if not isinstance(tokens, torch.Tensor) else tokens,
        sampling_params=SamplingParams(num_tokens_to_generate=n),
        **kw,
    )


def i32(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)
