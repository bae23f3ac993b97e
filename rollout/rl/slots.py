"""The engine requests a RolloutManager waits for: where each merged record goes (a group
member or an episode's turn) and the FAILED record that stands in for one that never ran."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from rollout.request import DynamicInferenceRequest


@dataclasses.dataclass
class Slot:
    """An engine request the manager waits for: its prompt (for a FAILED record) and who gets
    its merged record (a group member, or an episode's turn)."""

    prompt: Any
    deliver: Callable[[DynamicInferenceRequest], None]


def failed_record(rid: int, prompt: Any, error: Exception) -> DynamicInferenceRequest:
    """A FAILED record for request `rid` (its prompt kept when it is a prompt)."""
    text = prompt if isinstance(prompt, str) else None
    tokens = None
    with contextlib.suppress(ValueError, TypeError):  # a prompt the engine could not take
        tokens = None if prompt is None or text is not None else torch.as_tensor(prompt)
    req = DynamicInferenceRequest(rid, prompt=text)
    if tokens is not None and tokens.dim() == 1 and not tokens.is_floating_point():
        req.prompt_tokens = tokens.to(torch.int64)
    req.mark_failed(error)
    return req


def resolve(fut: asyncio.Future, req: DynamicInferenceRequest) -> None:
    """Hand an episode's turn its record (on the environment loop; once)."""
    if not fut.done():
        fut.set_result(req)
