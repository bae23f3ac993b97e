"""A request resumed on another engine: the record its DISPATCH checkpoint describes.

When an engine dies, the coordinator re-dispatches its requests with what they streamed so far
(tokens, log-probs, and the weight version that sampled each token). The new engine continues
from a record that already holds those tokens, stamped with the versions of the engine that
sampled them, not its own: an update may have landed since, and policy staleness is computed
from these stamps. With routing replay the experts rows it streamed come back too (the first
prompt's rows first, when they were recorded), so the record keeps every token's experts.
"""

from __future__ import annotations

import torch

from rollout.engine.routing import RoutingRecorder
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


def resume_routing(record: DynamicInferenceRequestRecord, experts: bytes, engine: object) -> None:
    """Put a checkpoint's streamed experts rows (`pack_experts`) back into the resumed record;
    ValueError when they do not fit its tokens or this engine's model."""
    if not experts:
        return
    routing: RoutingRecorder | None = getattr(engine, "routing", None)
    req = record.requests[0]
    if routing is None:
        raise ValueError(
            f"resume checkpoint of request {req.request_id} carries routed experts but this "
            f"engine's model has no MoE layers"
        )
    row_bytes = routing.layers * routing.k * routing.dtype.itemsize
    if len(experts) % row_bytes:
        raise ValueError(
            f"resume checkpoint of request {req.request_id}: {len(experts)} bytes of routed "
            f"experts are not whole [{routing.layers}, {routing.k}] rows"
        )
    rows = torch.frombuffer(bytearray(experts), dtype=routing.dtype)
    rows = rows.view(-1, routing.layers, routing.k)
    n, prompt = len(req.generated_tokens), max(req.prompt_length - 1, 0)
    if len(rows) == n + prompt and prompt:
        req.prompt_routed_experts, rows = rows[:prompt].clone(), rows[prompt:]
    elif len(rows) != n:
        raise ValueError(
            f"resume checkpoint of request {req.request_id} has {n} tokens but {len(rows)} "
            f"rows of routed experts"
        )
    req.routed_experts = [r.clone() for r in rows]
