"""A request resumed on another engine: the record its DISPATCH checkpoint describes.

When an engine dies, the coordinator re-dispatches its requests with what they streamed so far
(tokens, log-probs, and the weight version that sampled each token). The new engine continues
from a record that already holds those tokens, stamped with the versions of the engine that
sampled them, not its own: an update may have landed since, and policy staleness is computed
from these stamps.
"""

from __future__ import annotations

import torch

from rollout.protocol import unpack_floats, unpack_tokens_array, unpack_versions
from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord, Status
from rollout.sampling import SamplingParams


def resume_record(
    request_id: int,
    prompt_tokens: torch.Tensor,
    sampling_params: SamplingParams,
    block_size: int,
    tokens: bytes,
    log_probs: bytes,
    versions: bytes,
) -> DynamicInferenceRequestRecord:
    """The record of `request_id` with the packed checkpoint appended (COMPLETED when it already
    holds every token to generate); ValueError for a checkpoint whose parts disagree."""
    req = DynamicInferenceRequest(
        request_id=request_id,
        sampling_params=sampling_params,
        prompt_tokens=prompt_tokens,
        block_size_tokens=block_size,
    )
    ids = unpack_tokens_array(tokens).tolist()
    lps, stamps = unpack_floats(log_probs), unpack_versions(versions)
    if len(stamps) != len(ids) or len(lps) not in (0, len(ids)):
        raise ValueError(
            f"resume checkpoint of request {request_id} has {len(ids)} tokens but {len(lps)} "
            f"log-probs and {len(stamps)} weight versions"
        )
    for i, (t, v) in enumerate(zip(ids, stamps, strict=True)):
        req.append_token(t, lps[i] if lps else None, None, v)
    req.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
    if req.remaining_tokens_to_generate <= 0:
        req.status, req.stop_reason = Status.COMPLETED, "length"
        req.add_event_finish()
    return DynamicInferenceRequestRecord.from_request(req)
