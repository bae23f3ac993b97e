"""One DISPATCH row (rollout.protocol) into an engine: a new request, with the coordinator's
block hashes when they fit this engine, or one resumed from another engine's checkpoint
(rollout.serving.resume). A routing-replay request whose record could pass the coordinator's
frame limit is refused up front (rollout.serving.replies.routed_record_bound)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout.engine.interface import EngineProtocol
from rollout.protocol import unpack_hashes, unpack_obj, unpack_tokens_array
from rollout.request import DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams
from rollout.serving.replies import routed_record_bound
from rollout.serving.resume import resume_record, resume_routing
from rollout.tokenizers import tokenize_with


def admit(
    engine: EngineProtocol, row: list, block_size: int, max_frame_bytes: int
) -> DynamicInferenceRequestRecord | None:
    """Add `row`'s request to `engine`; the record to answer with at once instead (a resumed
    request that already holds every token), else None. ValueError / ProtocolError for a row
    that cannot run: the caller answers it with a FAILED record."""
    rid, prompt, sp_bytes, hashes, resume_tokens, resume_log_probs, resume_versions = row[:7]
    resume_experts = row[8]
    sp = SamplingParams.deserialize(unpack_obj(sp_bytes))
    tokens = (
        torch.from_numpy(unpack_tokens_array(prompt).astype(np.int64))
        if isinstance(prompt, bytes)
        else prompt
    )
    if resume_tokens:
        if isinstance(tokens, str):
            tokens = torch.tensor(_tokenize(engine, tokens), dtype=torch.int64)
        record = resume_record(rid, tokens, sp, block_size, resume_tokens,
                               resume_log_probs, resume_versions)  # fmt: skip
        resume_routing(record, resume_experts, engine)
        if record.requests[-1].remaining_tokens_to_generate <= 0:
            return record
        engine.add_request(rid, record=record)
    else:
        _check_routed_size(engine, tokens, sp, max_frame_bytes)
        forwarded = _forwarded_hashes(tokens, hashes, block_size)
        engine.add_request(rid, tokens, sp, precomputed_block_hashes=forwarded)
    return None


def _check_routed_size(
    engine: EngineProtocol, prompt: Any, sp: SamplingParams, max_frame_bytes: int
) -> None:
    """Refuse now (ValueError) a routing-replay request whose record could pass the frame
    limit: it would otherwise fail only after its whole generation."""
    routing = getattr(engine, "routing", None)
    if not sp.return_routed_experts or routing is None:
        return
    row = routing.layers * routing.k * torch.empty(0, dtype=routing.dtype).element_size()
    # a text prompt has at most one token a byte (plus BOS)
    n = len(prompt.encode()) + 1 if isinstance(prompt, str) else len(prompt)
    n += sp.num_tokens_to_generate
    cap = getattr(getattr(engine, "config", None), "max_sequence_length", None)
    n = min(n, cap) if isinstance(cap, int) else n
    need = routed_record_bound(n, row, sp.top_n_logprobs)
    if need > max_frame_bytes:
        raise ValueError(
            f"routing replay of up to {n} tokens ({row} bytes of experts a token) needs a "
            f"reply of up to {need} bytes, over the coordinator's frame limit "
            f"(max_frame_bytes={max_frame_bytes}): ask fewer tokens, or start the "
            f"coordinator with max_frame_bytes >= {need}"
        )


def _forwarded_hashes(tokens: Any, packed: bytes | None, block_size: int) -> list[int] | None:
    """The coordinator's block hashes of a token prompt (hashed once, there), when they were
    made with this engine's block size; the engine verifies tokens on every hit anyway."""
    if not packed or isinstance(tokens, str):
        return None
    hashes = unpack_hashes(packed)
    return hashes if len(hashes) == len(tokens) // block_size else None


def _tokenize(engine: EngineProtocol, text: str) -> list[int]:
    """Tokenize exactly as the engine does for a new text prompt (BOS included)."""
    if engine.tokenizer is None:
        raise ValueError("cannot resume a text prompt: the engine has no tokenizer")
    return tokenize_with(engine.tokenizer, text, bos=True)
