"""What an engine worker sends back: a step's partials and finished records as rows, in frames
under the coordinator's size limit, and the FAILED record of a request that ran nowhere.

The coordinator's ROUTER drops the connection of a peer whose frame is larger than its
`max_frame_bytes`, so a step that finishes many long records goes out as several frames, and a
record too large for any frame is replaced by a FAILED one saying why (it fails instead of
vanishing).

Routing replay makes records large (a big MoE model: 94 layers x top-8 is 752 bytes a token,
64 MB near 85k tokens), and such a record would only fail once its whole generation is done.
So its size is bounded up front (`routed_record_bound`): the engine worker refuses at once a
routing-replay request whose record could pass the frame limit, and `EngineCluster` sizes its
coordinator's limit from the model (`frame_bytes_for_routing`) so that a request of the longest
sequence the engines accept fits.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rollout.protocol import (
    MAX_BATCH_ROWS,
    pack_experts,
    pack_floats,
    pack_obj,
    pack_tokens,
    pack_versions,
)
from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord

# Bytes a reply row adds to its frame beyond the payload (msgpack list, id, bin headers), and a
# frame beyond its rows: generous upper bounds, so a frame sized with them stays under the limit.
ROW_OVERHEAD = 32
FRAME_OVERHEAD = 64


# A routing-replay record's bytes a token beyond its experts row (token id, log-prob, versions,
# staleness; measured ~32) and a top-n log-prob's; the record's fixed part: upper bounds
ROUTED_TOKEN_BYTES, TOP_N_BYTES, RECORD_FIXED_BYTES = 48, 24, 4096


def routed_record_bound(tokens: int, row_bytes: int, top_n: int = 0) -> int:
    """An upper bound of the serialized record of a routing-replay request of `tokens` tokens
    (prompt and generated), each with an experts row of `row_bytes`."""
    per_token = row_bytes + ROUTED_TOKEN_BYTES + TOP_N_BYTES * top_n
    return tokens * per_token + RECORD_FIXED_BYTES + ROW_OVERHEAD + FRAME_OVERHEAD


def frame_bytes_for_routing(row_bytes: int, max_sequence_length: int) -> int:
    """The frame limit that carries the record of a routing-replay request of the longest
    sequence (without top-n log-probs)."""
    return routed_record_bound(max_sequence_length, row_bytes)


def failed_record(request_id: int, error: BaseException) -> DynamicInferenceRequestRecord:
    """The FAILED record of a request that produced none (refused, lost, or too large to send)."""
    req = DynamicInferenceRequest(
        request_id=request_id, prompt_tokens=torch.zeros(0, dtype=torch.int64)
    )
    req.mark_failed(error)
    return DynamicInferenceRequestRecord.from_request(req)


def record_bytes(record: DynamicInferenceRequestRecord, max_frame_bytes: int) -> bytes:
    """`record` serialized, or a FAILED record in its place when no frame could carry it."""
    blob = record.to_bytes()
    if len(blob) + ROW_OVERHEAD + FRAME_OVERHEAD <= max_frame_bytes:
        return blob
    error = ValueError(f"record of {len(blob)} bytes exceeds the coordinator's frame limit "
                       f"(max_frame_bytes={max_frame_bytes})")  # fmt: skip
    return failed_record(record.request_id, error).to_bytes()


def frame_bounds(sizes: list[int], max_frame_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of the rows of each frame, given each row's size: at most MAX_BATCH_ROWS
    rows and half the frame limit per frame; a row bigger than that (checked to fit the limit)
    goes alone. Always at least one frame."""
    budget = max_frame_bytes // 2
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (total + size > budget or i - start >= MAX_BATCH_ROWS):
            yield start, i
            start, total = i, 0
        total += size
    yield start, len(sizes)


def partial_rows(partials: list[tuple], active: set[int]) -> list[list]:
    """The REPLY_PARTIAL rows of a step's partials (StepOutput.partials) of the requests in
    `active` (the others were given elsewhere): tokens, log-probs and versions packed, then
    the optional top-n and routing-replay payloads."""
    return [
        [
            rid,
            pack_tokens(toks),
            pack_floats(lps),
            pack_versions(versions),
            _extra(tops),
            _experts_bytes(experts),
        ]
        for rid, toks, lps, versions, tops, *experts in partials
        if rid in active
    ]


def partial_sizes(rows: list[list]) -> list[int]:
    """Each partial row's bytes in a frame (for frame_bounds)."""
    return [sum(len(f or b"") for f in r[1:]) + ROW_OVERHEAD for r in rows]


def _extra(top_n_logprobs: list[dict]) -> bytes | None:
    """A partial's optional payload: the top log-probs of its tokens, when they were asked."""
    return pack_obj({"top_n_logprobs": top_n_logprobs}) if top_n_logprobs else None


def _experts_bytes(rest: list) -> bytes | None:
    """A partial's routing-replay rows (the engine partial's sixth element) as packed bytes."""
    return pack_experts(rest[0]) if rest and rest[0] is not None else None
