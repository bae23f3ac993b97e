"""After the forward: what each request of the step takes from it.

Its sampled token (with its log-prob and top-n, its routed experts, a stop check and, every
`streaming_interval` tokens, a partial for the step's output), its prompt log-probs, its newly
complete blocks for the prefix cache, and, once it stops, its finished record. Each runs for one
request under the engine's `_isolated`, so a fault here fails that request alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rollout.engine import grammar, sampler
from rollout.engine.block_manager import NO_PARENT
from rollout.engine.interface import StepOutput
from rollout.engine.sequence import Sequence
from rollout.request import Status
from rollout.tokenizers import detokenize_with

if TYPE_CHECKING:
    from rollout.engine.engine import DynamicInferenceEngine


def sample(
    engine: DynamicInferenceEngine, seqs: list[Sequence], logits: torch.Tensor, out: StepOutput
) -> None:
    """Sample every row (a row that cannot be sampled fails its request alone), then
    append each token and check its stop conditions, request by request."""
    params = [s.request.sampling_params for s in seqs]
    seeds, positions = [s.seed for s in seqs], [len(s.tokens) for s in seqs]
    mask = grammar.token_mask([s.grammar for s in seqs], logits.shape[-1],
                              lambda i, e: engine._fail_seq(seqs[i], "grammar mask", e))  # fmt: skip
    result, faults = sampler.sample_isolated(logits, params, seeds, positions,
                                             [s.processors for s in seqs], mask)  # fmt: skip
    now = time.time()
    for i, seq in enumerate(seqs):
        if i in faults:
            engine._fail_seq(seq, "sampling", faults[i])
        elif engine._seqs.get(seq.request_id) is seq:
            engine._isolated(seq, "token bookkeeping", take_token, engine, seq, result, i, now,
                             out)  # fmt: skip


def take_token(
    engine: DynamicInferenceEngine,
    seq: Sequence,
    result: sampler.SampleOutput,
    i: int,
    now: float,
    out: StepOutput,
) -> None:
    """Append row `i` of `result` to `seq`; complete it on a stop, else stream a partial when
    one is due."""
    sp = seq.request.sampling_params
    token = result.tokens[i]
    if seq.grammar is not None:
        seq.grammar.accept(token)
    lp = result.log_probs[i] if sp.return_log_probs else None
    top = result.top_n[i] if sp.top_n_logprobs else None
    if top and seq.processors is not None:  # masked tokens (-inf) are not among the top
        top = {k: v for k, v in top.items() if v != float("-inf")}
    seq.request.append_token(token, lp, top, engine.weight_version, now)
    if engine.routing is not None and (experts := engine.routing.take(seq)) is not None:
        seq.request.routed_experts.append(experts)
    seq.tokens.append(token)
    if lp is not None:
        seq.log_probs.append(lp)
    engine.counters["tokens_generated"] += 1
    reason = seq.stop_reason(token)
    if reason is None and seq.grammar is not None and seq.grammar.finished:
        reason = "eos"  # the grammar took its stop token (ignore_eos): nothing may follow
    interval = engine.config.streaming_interval
    if reason is not None:
        complete(engine, seq, reason)
    elif interval and (seq.num_generated - seq.streamed >= interval or seq.streamed == 0):
        out.partials.append(seq.take_partial())  # the first token at once (a stream's TTFT)


def complete(engine: DynamicInferenceEngine, seq: Sequence, reason: str) -> None:
    """Finish `seq` with `reason` (its record comes out of this step); a fault while
    finishing (detokenization) fails it instead."""
    try:
        _finish(engine, seq, reason)
    except Exception as e:
        engine._fail_seq(seq, "detokenization" if reason != "abort" else "abort", e)
        return
    engine._seqs.pop(seq.request_id, None)
    engine.scheduler.remove(seq)
    engine._done.append(seq.record)


def _finish(engine: DynamicInferenceEngine, seq: Sequence, reason: str) -> None:
    record, req = seq.record, seq.request
    text = detokenize_with(engine.tokenizer, seq.tokens[seq.first_prompt_len :])  # may raise
    if seq.text_end is not None:  # cut at the stop word
        text = seq.text.text[: seq.text_end]
    req.stop_reason = reason
    req.status = Status.COMPLETED
    req.add_event_finish()
    for r in record.requests[:-1]:
        r.generated_text = ""
    req.generated_text = text
    req.latency = record.latency = time.time() - req.arrival_time
    req.staleness_version = engine.weight_version  # what its staleness counters count from
    engine.counters["requests_finished"] += 1


def register_blocks(
    engine: DynamicInferenceEngine, seq: Sequence, computed: int | None = None
) -> None:
    """Offer `seq`'s newly completed blocks (of its first `computed` tokens, by default
    all it has KV for) to the prefix cache."""
    bs = engine.config.block_size
    full = (seq.num_computed if computed is None else computed) // bs
    if not seq.cacheable or full <= seq.num_registered or not seq.block_table:
        return
    hashes = seq.block_hashes(full)
    for i in range(seq.num_registered, full):
        parent = seq.block_table[i - 1] if i else NO_PARENT
        engine.blocks.register(seq.block_table[i], hashes[i], seq.tokens[i * bs : (i + 1) * bs],
                               parent, engine.weight_version, seq.cache_salt)  # fmt: skip
    seq.num_registered = full


def prompt_log_probs(item: tuple[Sequence, int, int, int], logits: torch.Tensor | None) -> None:
    """The log-probs (and top-n) of the prompt tokens this step computed, for `item`'s
    sequence; the request gets them once its whole prompt is scored."""
    seq, first, start, count = item
    req = seq.request
    top_n = req.sampling_params.top_n_logprobs
    seq.prompt_lp = seq_lp = seq.prompt_lp[:start]
    seq.prompt_top_n = seq_top = seq.prompt_top_n[:start]
    targets = torch.tensor(seq.tokens[start + 1 : start + 1 + count])
    temperature = req.sampling_params.logprobs_temperature
    lp, top = sampler.prompt_log_probs(logits[first : first + count], targets, top_n, temperature)
    seq_lp.extend(lp)
    seq_top.extend(top)
    if len(seq_lp) == req.prompt_length - 1:
        req.prompt_log_probs = seq_lp
        if top_n:
            req.prompt_top_n_logprobs = seq_top
