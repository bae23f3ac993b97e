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

from dataclasses import dataclass

import torch

from rollout.engine.model_runner import PreparedBatch
from rollout.engine.sampler import DeviceSample
from rollout.engine.sequence import Sequence


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
