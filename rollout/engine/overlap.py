"""Async scheduling (InferenceConfig.async_scheduling): the host lags the device by one step.

A decode-only step's samples stay on the device (`InFlight`); the next step, when it is again
decode-only over the same sequences, feeds them straight to its forward and only then reads
them (one device-to-host sync per step), so the host's bookkeeping for step k (stop checks,
detokenization, records) runs while the device computes step k+1, as in vLLM v1's async
scheduling. Everything else is synchronous, as without the option: a step that prefills,
admits, evicts or needs a new KV block first drains the in-flight step (`drain`), and so do
the lifecycle calls (abort, discard, weight updates, suspend), so that no token is stamped
with a version other than the one that sampled it and the scheduler never sees a sequence
whose last token is not known yet.

While a step is in flight its sequences hold `len(tokens) == num_computed` (the token being
sampled is not in `tokens` yet); after `drain` they are back to `num_computed + 1`. A sequence
that finishes on step k's token was computed once more by step k+1: that token is discarded
when step k+1 is read, and its blocks, freed when it finished, are reused only by later work
in stream order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.engine import sampler
from rollout.engine.interface import StepOutput
from rollout.engine.model_runner import PreparedBatch
from rollout.engine.postprocess import register_blocks, take_token
from rollout.engine.sampler import DeviceSample
from rollout.engine.sequence import Sequence

if TYPE_CHECKING:
    from rollout.engine.engine import DynamicInferenceEngine

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched decode step whose samples the host has not read."""

    seqs: list[Sequence]
    sample: DeviceSample


def can_follow(
    flight: InFlight,
    running: list[Sequence],
    waiting_empty: bool,
    block_size: int,
    max_sequence_length: int,
    max_tokens_per_step: int,
) -> bool:
    """Whether the next step can be the decode of exactly `flight`'s sequences without the
    scheduler, i.e. what the scheduler would do: nothing waits for admission, every running
    sequence is in flight, the token budget holds them all, and each has a KV slot for its
    next position in the blocks it already holds."""
    n = len(flight.seqs)
    if not waiting_empty or len(running) != n or n > max_tokens_per_step:
        return False
    ids = {id(s) for s in flight.seqs}
    for seq in running:
        c = seq.num_computed
        if id(seq) not in ids or c >= max_sequence_length or c >= len(seq.block_table) * block_size:
            return False
    return True


def decode_batch(
    seqs: list[Sequence], block_size: int, device: torch.device | str | None
) -> PreparedBatch:
    """The decode of position `num_computed` of each sequence; its token (the previous step's
    sample, still on the device) is given to the runner separately, so `tokens` holds zeros."""
    n = len(seqs)
    rows = list(range(n))
    return PreparedBatch(
        tokens=[0] * n,
        positions=[s.num_computed for s in seqs],
        query_lens=[1] * n,
        context_lens=[s.num_computed + 1 for s in seqs],
        block_tables=[s.block_table for s in seqs],
        block_size=block_size,
        device=device,
        logit_rows=rows,
        sample_at=list(rows),
        samplers=list(seqs),
        prompt_lp=[],
    )


def sample_on_device(
    seqs: list[Sequence], logits: torch.Tensor, positions: list[int]
) -> sampler.DeviceSample:
    """`seqs`' next tokens, sampled and left on the device."""
    params = [s.request.sampling_params for s in seqs]
    return sampler.sample_on_device(logits, params, [s.seed for s in seqs], positions,
                                    [s.processors for s in seqs])  # fmt: skip


def follow(engine: DynamicInferenceEngine, out: StepOutput) -> bool:
    """Launch the decode of the in-flight sequences on their device-side samples, then
    read and bookkeep those samples while the device works. False (nothing done) when the
    next step needs the scheduler or the launch fails: the caller drains and schedules."""
    flight, config = engine._inflight, engine.config
    if flight is None or engine.routing is not None or not can_follow(
        flight, engine.scheduler.running, not engine.scheduler.waiting, config.block_size,
        config.max_sequence_length, config.max_tokens_per_step,
    ):  # fmt: skip
        return False
    seqs = flight.seqs
    try:
        prep = decode_batch(seqs, config.block_size, engine.device)
        t0 = time.perf_counter()
        logits = engine.runner.logits(prep, engine.kv.cache, token_ids=flight.sample.tokens)
        engine.counters["forward_time_s"] += time.perf_counter() - t0
        nxt = sample_on_device(seqs, logits, [s.num_computed + 1 for s in seqs])
    except Exception:  # the synchronous path recomputes the same K/V and isolates faults
        log.debug("overlapped decode failed; running the step synchronously", exc_info=True)
        return False
    engine.counters["steps"] += 1
    engine.counters["overlapped_steps"] += 1
    engine.blocks.stats.tokens_computed += len(seqs)
    for seq in seqs:
        seq.num_computed += 1
    engine._inflight = None
    _resolve(engine, flight, out)
    engine._inflight = InFlight(seqs, nxt)
    return True


def drain(engine: DynamicInferenceEngine, out: StepOutput | None = None) -> None:
    """Read and bookkeep the in-flight step, if any (partials go to `out`, else to the
    next step's output): the host catches up with the device."""
    flight, engine._inflight = engine._inflight, None
    if flight is None:
        return
    sink = out if out is not None else StepOutput()
    _resolve(engine, flight, sink)
    if out is None:
        engine._late_partials.extend(sink.partials)


def _resolve(engine: DynamicInferenceEngine, flight: InFlight, out: StepOutput) -> None:
    """Take `flight`'s tokens (one device-to-host sync) into the sequences still in the
    engine; a sequence that finished, failed or was aborted since its launch drops its
    token (computed past its end)."""
    try:
        result = sampler.to_host(flight.sample)
    except Exception as e:  # its sequences' last token is lost: they cannot go on
        for seq in flight.seqs:
            engine._fail_seq(seq, "reading the in-flight step", e)
        return
    now = time.time()
    for i, seq in enumerate(flight.seqs):
        if engine._seqs.get(seq.request_id) is not seq:
            continue
        if engine.config.enable_prefix_caching:  # blocks of known tokens, before any finish
            engine._isolated(seq, "prefix-cache registration", register_blocks, engine, seq,
                             len(seq.tokens))  # fmt: skip
        if engine._seqs.get(seq.request_id) is seq:
            engine._isolated(seq, "token bookkeeping", take_token, engine, seq, result, i, now,
                             out)  # fmt: skip
