"""`DynamicInferenceEngine`: continuous batching over a paged KV cache, one `step()` at a time.

The engine owns the KV pool, the block manager (with its prefix cache), the scheduler and the
sampler; the model only maps (tokens, positions, block tables) to hidden states. Everything a
caller sees goes through request records (rollout.request): tokens, raw-logit log-probs, events,
timings, per-token policy/KV staleness and the weight version that sampled each token.

Lifecycle for RL: `suspend(mode)` frees the KV memory between training steps ("offload" copies
it to host memory, "recompute" drops it and re-prefills every in-flight request on `resume()`),
and `update_weights(state_dict, version)` swaps the weights in place under the configured KV
policy, so unfinished requests carry over with exact staleness.

Fault model: a fault in a step that one request explains (its scheduling, sampling row, stop
check, detokenization, log-prob extraction) fails that request alone with a RequestFault in
its record and frees its blocks; the rest of the step goes on. A fault no request explains
(the forward, batch preparation) fails the requests of that step and the engine goes on,
counted in `step_failures`; only MAX_STEP_FAILURES_IN_A_ROW failed steps in a row (a broken
device) raise EngineBrokenError out of `step()`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch
from torch import nn

from rollout.engine import grammar, introspection, sampler
from rollout.engine.block_manager import NO_PARENT, BlockManager
from rollout.engine.config import InferenceConfig
from rollout.engine.cuda_graphs import DecodeGraphs
from rollout.engine.intake import (
    Prompt,
    RequestError,
    check_request,
    check_stop_words,
    new_record,
)
from rollout.engine.interface import StepOutput
from rollout.engine.kv_pool import KVPool
from rollout.engine.logits_processors import RequestLogits
from rollout.engine.model_runner import ModelRunner, prepare_batch
from rollout.engine.overlap import InFlight, can_follow, decode_batch
from rollout.engine.routing import RoutingRecorder, check_routing
from rollout.engine.scheduler import ScheduledBatch, Scheduler
from rollout.engine.sequence import Sequence, check_block_hashes
from rollout.engine.staging import Staged, WeightStage, check_update
from rollout.engine.weights_residency import WeightsResidency
from rollout.models import batch_invariant as bi
from rollout.protocol import SUSPEND_MODES
from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord, Status
from rollout.sampling import SamplingParams
from rollout.tokenizers import detokenize_with, eos_ids_of

MAX_STEP_FAILURES_IN_A_ROW = 3  # then the device, not a request, is at fault
log = logging.getLogger(__name__)


class RequestFault(RuntimeError):
    """A fault inside a step that failed one request (the cause is in the message)."""


class EngineBrokenError(RuntimeError):
    """Steps keep failing whatever requests they hold: the process should be restarted."""


def set_batch_invariant(
    model: nn.Module, on: bool, dtype: torch.dtype, device: torch.device
) -> None:
    """Switch `model` to the batch-invariant ops after checking this machine gives them
    (rollout.models.batch_invariant.check_machine raises BatchInvariantUnsupported naming the
    op), or back to the default ops; ValueError for a model without the mode."""
    if not on:
        if hasattr(model, "batch_invariant"):
            model.batch_invariant = False
        return
    if not hasattr(model, "batch_invariant"):
        raise ValueError(
            "InferenceConfig.batch_invariant needs a rollout.models.DecoderLM "
            f"(got {type(model).__name__})"
        )
    bi.check_machine(dtype, device)
    model.batch_invariant = True


class DynamicInferenceEngine:
    """Serve requests on `model` (a rollout.models.DecoderLM or compatible) with `tokenizer`."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        config: InferenceConfig | None = None,
        weight_version: int = 0,
    ) -> None:
        self.config = config = config or InferenceConfig()
        if not isinstance(config, InferenceConfig):
            raise ValueError(f"config must be an InferenceConfig, got {type(config).__name__}")
        self.model_config = getattr(model, "config", None)
        if self.model_config is None or not hasattr(model, "forward_paged"):
            raise ValueError(
                "model must expose .config and .forward_paged (rollout.models.DecoderLM; "
                "rollout.models.from_transformers converts a transformers model)"
            )
        window = getattr(self.model_config, "sliding_window", None)
        if window is not None and window < config.max_sequence_length:
            raise ValueError(
                f"the model's sliding_window={window} is shorter than max_sequence_length="
                f"{config.max_sequence_length}: sliding-window attention is not supported; "
                f"serve at most {window} tokens per sequence"
            )
        param = next(model.parameters())
        device = torch.device(config.device) if config.device is not None else param.device
        dtype = config.torch_dtype or param.dtype
        if param.device != device or param.dtype != dtype:
            model.to(device=device, dtype=dtype)
        self.model = model.eval()
        set_batch_invariant(self.model, config.batch_invariant, dtype, device)
        backend = config.resolve_attention_backend(device)
        graphs = DecodeGraphs.for_engine(self.model, config, device, backend)
        self.runner = ModelRunner(self.model, graphs, attention_backend=backend)
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        self.vocab_size = int(self.model_config.vocab_size)
        self.weight_version = int(weight_version)

        self.kv = KVPool(self.model_config, config, device, dtype)
        self.routing = RoutingRecorder.for_model(  # None: no MoE layers
            self.model, config.block_size if config.enable_prefix_caching else None,
            self.kv.num_blocks)  # fmt: skip
        self.suspended: str | None = None  # the suspend mode, None while serving
        self.closed = False

        self.blocks = BlockManager(self.kv.num_blocks, config.block_size,
                                   config.enable_prefix_caching)  # fmt: skip
        self.scheduler = Scheduler(config, self.blocks, self._on_evict, self._on_admit,
                                   self._on_fault)  # fmt: skip
        self._seqs: dict[int, Sequence] = {}
        self._done: list[DynamicInferenceRequestRecord] = []  # failed/aborted, out next step
        self._ids = itertools.count()
        self._seed_rng = int.from_bytes(os.urandom(8), "little")
        self._eos = eos_ids_of(tokenizer, self.model_config)
        self._decode = functools.partial(detokenize_with, tokenizer) if tokenizer else None
        self.grammars = grammar.Grammars(tokenizer, self.vocab_size, self._eos)
        self.counters = {"steps": 0, "tokens_generated": 0, "requests_finished": 0,
                         "requests_failed": 0, "request_faults": 0, "step_failures": 0,
                         "weight_updates": 0, "forward_time_s": 0.0,
                         "overlapped_steps": 0}  # fmt: skip
        self._failures_in_a_row = 0
        self._inflight: InFlight | None = None  # async_scheduling: samples not read yet
        self._late_partials: list[tuple] = []  # read by a drain outside step(): out next step
        self.weight_stage = WeightStage(self.model)  # its buffer is allocated on first use
        self.residency = WeightsResidency(self.model)  # freed while asleep (release_weights)

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: int | None,
        prompt: Prompt | None = None,
        sampling_params: SamplingParams | None = None,
        record: DynamicInferenceRequestRecord | None = None,
        precomputed_block_hashes: Seq[int] | torch.Tensor | None = None,
        routing_key: str | None = None,  # one engine: nothing to route (EngineProtocol)
    ) -> DynamicInferenceRequestRecord:
        """Queue a request (or resume a checkpointed `record`). A request that can never be
        served becomes a FAILED record returned by the next step(); the engine goes on.

        `precomputed_block_hashes`: the chained hashes (rollout.hashing, this engine's block
        size) of the leading complete blocks of the prompt (of the resumed segment's prompt
        for `record=`), e.g. the coordinator's; they replace hashing here. At most one per
        complete block. A wrong hash only costs cache hits: every hit is verified on tokens."""
        given = check_block_hashes(precomputed_block_hashes)
        if record is None:
            record, error = new_record(self._new_id(request_id), prompt, sampling_params,
                                       self.tokenizer, self.config.block_size,
                                       self.config.enable_prefix_caching)  # fmt: skip
            if error is not None:
                record.requests[-1].add_event_add_engine()
                self._fail(record, error)
                return record
        elif not isinstance(record, DynamicInferenceRequestRecord) or not record.requests:
            raise ValueError("record must be a non-empty DynamicInferenceRequestRecord")
        rid = record.request_id
        if rid in self._seqs or any(r.request_id == rid for r in self._done):
            raise ValueError(f"request_id {rid} is already in the engine")
        if record.requests[-1].status == Status.FAILED:
            self._done.append(record)
            return record
        req = record.requests[-1]
        if req.generated_tokens and req.remaining_tokens_to_generate > 0:
            record.checkpoint()  # resume: everything so far becomes the prompt
            req = record.requests[-1]  # its leading blocks, and their given hashes, are the same
        req.status = Status.WAITING_IN_QUEUE
        req.add_event_add_engine()
        try:
            check_request(req, self.config, self.vocab_size, self.kv.num_blocks)
            check_routing(req, self.routing)
            check_stop_words(self.tokenizer, req.sampling_params)
            processors = RequestLogits.for_request(req.sampling_params, self.tokenizer,
                                                   self.vocab_size, self._eos)  # fmt: skip
        except RequestError as e:
            self._fail(record, e)
            return record
        sp = req.sampling_params
        seed = sp.seed if sp.seed is not None else self._next_seed()
        if sp.seed is None:  # recorded: a checkpoint, a re-dispatch and a replay keep the stream
            req.sampling_params = sp = sp.replace(seed=seed)
        full = req.prompt_length // self.config.block_size
        if given is not None and len(given) > full:
            raise ValueError(
                f"precomputed_block_hashes has {len(given)} hashes but the prompt has only "
                f"{full} complete blocks of {self.config.block_size} tokens"
            )
        if given:
            req.precomputed_block_hashes = list(given)
        seq = Sequence(record, seed, record.requests[0].prompt_length, self.config.block_size,
                       self._eos, given, self._decode)  # fmt: skip
        seq.streamed = seq.num_generated
        if processors is not None:  # counts rebuilt from the tokens of a resumed request
            seq.processors = processors.attach(seq.tokens, seq.first_prompt_len)
        seq.log_probs = [x for r in record.requests for x in r.generated_log_probs]
        if sp.structured_outputs is not None:  # resumed: re-advanced over what it generated
            try:
                seq.grammar = self.grammars.state(sp.structured_outputs,
                                                  seq.tokens[seq.first_prompt_len :])  # fmt: skip
            except ValueError as e:
                self._fail(record, RequestError(str(e)))
                return record
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return record

    def pop_evicted_hashes(self) -> list[int]:
        """Block hashes that left this engine's prefix cache (LRU eviction, weight-update drops,
        suspend(recompute)) since the last call and are not cached again; each once."""
        return self.blocks.pop_evicted_hashes()

    def _new_id(self, request_id: int | None) -> int:
        """`request_id`, or the next id no request in the engine holds."""
        if request_id is not None:
            return request_id
        request_id = next(self._ids)
        while request_id in self._seqs:
            request_id = next(self._ids)
        return request_id

    def _fail(self, record: DynamicInferenceRequestRecord, error: Exception) -> None:
        req = record.requests[-1]
        req.mark_failed(error)
        req.latency = record.latency = time.time() - req.arrival_time
        req.staleness_version = self.weight_version  # what its staleness counters count from
        self.counters["requests_failed"] += 1
        self._done.append(record)

    def _next_seed(self) -> int:
        self._seed_rng = sampler.splitmix64(self._seed_rng)
        return self._seed_rng >> 1

    def abort(self, request_id: int) -> bool:
        """Stop a request now; its record (stop_reason "abort") comes out of the next step."""
        self._drain()
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._complete(seq, "abort")
        return True

    def discard(self, request_id: int) -> None:
        """Forget a request without a record: its owner has given it to someone else (a
        coordinator that re-dispatched it) or is gone, so no reply may ever come out of here.
        Its blocks are freed."""
        self._drain()
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
        self._done = [r for r in self._done if r.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs) or bool(self._done)

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> StepOutput:
        """Schedule, run one forward over the flattened batch, sample, and bookkeep; faults
        fail requests, not the engine (see the module docstring)."""
        if self.closed:
            raise RuntimeError("engine is closed")
        if self.suspended is not None:
            raise RuntimeError(f"engine is suspended ({self.suspended}); call resume() first")
        if self.residency.missing:  # a forward over uninitialised memory: never
            raise RuntimeError("the weights were discarded: update_weights() before stepping")
        out = StepOutput(finished=self._done, partials=self._late_partials)
        self._done, self._late_partials = [], []
        batch: ScheduledBatch = []
        try:
            if not self._follow(out):
                self._drain(out)
                batch = self.scheduler.schedule(self.weight_version)
                if batch:
                    self.counters["steps"] += 1
                    self._run(batch, out)
            self._failures_in_a_row = 0
        except Exception as e:
            if self._step_failed(batch or [(s, 0) for s in self.scheduler.running], e):
                self._done[:0] = out.finished  # nothing is lost: a later step() returns them
                raise EngineBrokenError(
                    f"{self._failures_in_a_row} engine steps in a row failed, the last with "
                    f"{type(e).__name__}: {e}"
                ) from e
        out.finished.extend(self._done)
        self._done = []
        return out

    def _run(self, batch: ScheduledBatch, out: StepOutput) -> None:
        """One step's work. Per-request stages run under `_isolated`; a fault anywhere else
        (batch preparation, the forward) propagates to `step` as a step failure."""
        batch = [(s, n) for s, n in batch if self._isolated(s, "prefill setup", self._prepare, s)]
        if not batch:
            return
        prep = prepare_batch(batch, self.config.block_size, self.device)
        routes = [] if self.routing is not None and self.routing.wanted(batch) else None
        replay = self.routing.replay(batch) if routes is not None else None
        t0 = time.perf_counter()
        logits = self.runner.logits(prep, self.kv.cache, routes, replay)
        self.counters["forward_time_s"] += time.perf_counter() - t0
        if routes:
            self.routing.record(batch, routes, self.weight_version)
        self.blocks.stats.tokens_computed += prep.num_tokens
        for seq, n in batch:
            seq.num_computed += n
        if self.config.enable_prefix_caching:  # before finished sequences release their blocks
            for seq, _ in batch:
                self._isolated(seq, "prefix-cache registration", self._register_blocks, seq)
        for item in prep.prompt_lp:
            self._isolated(item[0], "prompt log-probs", self._prompt_log_probs, item, logits)
        if prep.samplers:
            logits = self.runner.sampling_logits(prep, logits)
            constrained = any(s.grammar is not None for s in prep.samplers)
            if (
                self.config.async_scheduling
                and prep.decode_only
                and self.routing is None
                and not any(s.needs_history for s in prep.samplers)
                and not constrained
            ):  # fmt: skip (a grammar's next mask needs the token)
                try:
                    self._inflight = InFlight(prep.samplers, self._sample_on_device(
                        prep.samplers, logits, [len(s.tokens) for s in prep.samplers]))  # fmt: skip
                    return
                except Exception:  # sampled again below, row by row where a row is at fault
                    log.debug("device-side sampling failed; sampling synchronously", exc_info=True)
            self._sample(prep.samplers, logits, out)

    # -- async scheduling (rollout.engine.overlap) ---------------------------------------------
    def _sample_on_device(
        self, seqs: list[Sequence], logits: torch.Tensor, positions: list[int]
    ) -> sampler.DeviceSample:
        params = [s.request.sampling_params for s in seqs]
        return sampler.sample_on_device(logits, params, [s.seed for s in seqs], positions,
                                        [s.processors for s in seqs])  # fmt: skip

    def _follow(self, out: StepOutput) -> bool:
        """Launch the decode of the in-flight sequences on their device-side samples, then
        read and bookkeep those samples while the device works. False (nothing done) when the
        next step needs the scheduler or the launch fails: the caller drains and schedules."""
        flight = self._inflight
        if flight is None or self.routing is not None or not can_follow(
            flight, self.scheduler.running, not self.scheduler.waiting, self.config.block_size,
            self.config.max_sequence_length, self.config.max_tokens_per_step,
        ):  # fmt: skip
            return False
        seqs = flight.seqs
        try:
            prep = decode_batch(seqs, self.config.block_size, self.device)
            t0 = time.perf_counter()
            logits = self.runner.logits(prep, self.kv.cache, token_ids=flight.sample.tokens)
            self.counters["forward_time_s"] += time.perf_counter() - t0
            nxt = self._sample_on_device(seqs, logits, [s.num_computed + 1 for s in seqs])
        except Exception:  # the synchronous path recomputes the same K/V and isolates faults
            log.debug("overlapped decode failed; running the step synchronously", exc_info=True)
            return False
        self.counters["steps"] += 1
        self.counters["overlapped_steps"] += 1
        self.blocks.stats.tokens_computed += len(seqs)
        for seq in seqs:
            seq.num_computed += 1
        self._inflight = None
        self._resolve(flight, out)
        self._inflight = InFlight(seqs, nxt)
        return True

    def _drain(self, out: StepOutput | None = None) -> None:
        """Read and bookkeep the in-flight step, if any (partials go to `out`, else to the
        next step's output): the host catches up with the device."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        sink = out if out is not None else StepOutput()
        self._resolve(flight, sink)
        if out is None:
            self._late_partials.extend(sink.partials)

    def _resolve(self, flight: InFlight, out: StepOutput) -> None:
        """Take `flight`'s tokens (one device-to-host sync) into the sequences still in the
        engine; a sequence that finished, failed or was aborted since its launch drops its
        token (computed past its end)."""
        try:
            result = sampler.to_host(flight.sample)
        except Exception as e:  # its sequences' last token is lost: they cannot go on
            for seq in flight.seqs:
                self._fail_seq(seq, "reading the in-flight step", e)
            return
        now = time.time()
        for i, seq in enumerate(flight.seqs):
            if self._seqs.get(seq.request_id) is not seq:
                continue
            if self.config.enable_prefix_caching:  # blocks of known tokens, before any finish
                self._isolated(seq, "prefix-cache registration", self._register_blocks, seq,
                               len(seq.tokens))  # fmt: skip
            if self._seqs.get(seq.request_id) is seq:
                self._isolated(seq, "token bookkeeping", self._take_token, seq, result, i, now, out)

    def _isolated(self, seq: Sequence, stage: str, fn: Callable[..., None], *args: Any) -> bool:
        """Run one request's part of the step; a fault fails that request alone (False)."""
        try:
            fn(*args)
            return True
        except Exception as e:
            self._fail_seq(seq, stage, e)
            return False

    def _fail_seq(self, seq: Sequence, stage: str, error: Exception) -> None:
        """Fail an in-flight request for a fault in `stage`; its blocks go back to the pool."""
        if self._seqs.get(seq.request_id) is not seq:
            return  # already finished, failed or aborted
        log.warning("request %s failed in %s", seq.request_id, stage, exc_info=error)
        self._seqs.pop(seq.request_id)
        self.scheduler.remove(seq)
        self.counters["request_faults"] += 1
        self._fail(seq.record, RequestFault(f"{stage} failed: {type(error).__name__}: {error}"))

    def _on_fault(self, seq: Sequence, error: Exception) -> None:
        self._fail_seq(seq, "scheduling", error)

    def _step_failed(self, batch: ScheduledBatch, error: Exception) -> bool:
        """A fault no request explains: fail the step's requests. True when the steps keep
        failing whatever they hold (the device, not a request, is broken)."""
        self.counters["step_failures"] += 1
        self._failures_in_a_row += 1
        log.error("engine step failed (%d in a row); failing its %d request(s)",
                  self._failures_in_a_row, len(batch), exc_info=error)  # fmt: skip
        for seq, _ in batch:
            self._fail_seq(seq, "engine step (no single request explains it)", error)
        return self._failures_in_a_row >= MAX_STEP_FAILURES_IN_A_ROW

    def _prepare(self, seq: Sequence) -> None:
        self._refresh_kv_staleness(seq, seq.num_computed)
        if seq.wants_prompt_log_probs and seq.request.prompt_length <= 1:
            seq.request.prompt_log_probs = []  # nothing to score
            if seq.request.sampling_params.top_n_logprobs:
                seq.request.prompt_top_n_logprobs = []

    def _refresh_kv_staleness(self, seq: Sequence, start: int) -> None:
        """KV computed from `start` on is fresh; after dropped KV, cached hits are fresh too."""
        if seq.kv_version == self.weight_version:
            return
        req = seq.request
        if req.kv_cache_staleness is not None:
            req.reset_kv_staleness(0 if seq.kv_version is None else start)
        seq.kv_version = self.weight_version

    def _prompt_log_probs(
        self, item: tuple[Sequence, int, int, int], logits: torch.Tensor | None
    ) -> None:
        seq, first, start, count = item
        req = seq.request
        top_n = req.sampling_params.top_n_logprobs
        seq.prompt_lp = seq_lp = seq.prompt_lp[:start]
        seq.prompt_top_n = seq_top = seq.prompt_top_n[:start]
        targets = torch.tensor(seq.tokens[start + 1 : start + 1 + count])
        temperature = req.sampling_params.logprobs_temperature
        lp, top = sampler.prompt_log_probs(
            logits[first : first + count], targets, top_n, temperature
        )
        seq_lp.extend(lp)
        seq_top.extend(top)
        if len(seq_lp) == req.prompt_length - 1:
            req.prompt_log_probs = seq_lp
            if top_n:
                req.prompt_top_n_logprobs = seq_top

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, out: StepOutput) -> None:
        """Sample every row (a row that cannot be sampled fails its request alone), then
        append each token and check its stop conditions, request by request."""
        params = [s.request.sampling_params for s in seqs]
        seeds, positions = [s.seed for s in seqs], [len(s.tokens) for s in seqs]
        mask = grammar.token_mask([s.grammar for s in seqs], logits.shape[-1],
                                  lambda i, e: self._fail_seq(seqs[i], "grammar mask", e))  # fmt: skip
        result, faults = sampler.sample_isolated(logits, params, seeds, positions,
                                                 [s.processors for s in seqs], mask)  # fmt: skip
        now = time.time()
        for i, seq in enumerate(seqs):
            if i in faults:
                self._fail_seq(seq, "sampling", faults[i])
            elif self._seqs.get(seq.request_id) is seq:
                self._isolated(seq, "token bookkeeping", self._take_token, seq, result, i, now, out)

    def _take_token(
        self, seq: Sequence, result: sampler.SampleOutput, i: int, now: float, out: StepOutput
    ) -> None:
        sp = seq.request.sampling_params
        token = result.tokens[i]
        if seq.grammar is not None:
            seq.grammar.accept(token)
        lp = result.log_probs[i] if sp.return_log_probs else None
        top = result.top_n[i] if sp.top_n_logprobs else None
        if top and seq.processors is not None:  # masked tokens (-inf) are not among the top
            top = {k: v for k, v in top.items() if v != float("-inf")}
        seq.request.append_token(token, lp, top, self.weight_version, now)
        if self.routing is not None and (experts := self.routing.take(seq)) is not None:
            seq.request.routed_experts.append(experts)
        seq.tokens.append(token)
        if lp is not None:
            seq.log_probs.append(lp)
        self.counters["tokens_generated"] += 1
        reason = seq.stop_reason(token)
        if reason is None and seq.grammar is not None and seq.grammar.finished:
            reason = "eos"  # the grammar took its stop token (ignore_eos): nothing may follow
        interval = self.config.streaming_interval
        if reason is not None:
            self._complete(seq, reason)
        elif interval and (seq.num_generated - seq.streamed >= interval or seq.streamed == 0):
            out.partials.append(seq.take_partial())  # the first token at once (a stream's TTFT)

    def _complete(self, seq: Sequence, reason: str) -> None:
        """Finish `seq` with `reason` (its record comes out of this step); a fault while
        finishing (detokenization) fails it instead."""
        try:
            self._finish(seq, reason)
        except Exception as e:
            self._fail_seq(seq, "detokenization" if reason != "abort" else "abort", e)
            return
        self._seqs.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        self._done.append(seq.record)

    def _finish(self, seq: Sequence, reason: str) -> None:
        record, req = seq.record, seq.request
        text = detokenize_with(self.tokenizer, seq.tokens[seq.first_prompt_len :])  # may raise
        if seq.text_end is not None:  # cut at the stop word
            text = seq.text.text[: seq.text_end]
        req.stop_reason = reason
        req.status = Status.COMPLETED
        req.add_event_finish()
        for r in record.requests[:-1]:
            r.generated_text = ""
        req.generated_text = text
        req.latency = record.latency = time.time() - req.arrival_time
        req.staleness_version = self.weight_version  # what its staleness counters count from
        self.counters["requests_finished"] += 1

    def _register_blocks(self, seq: Sequence, computed: int | None = None) -> None:
        """Offer `seq`'s newly completed blocks (of its first `computed` tokens, by default
        all it has KV for) to the prefix cache."""
        bs = self.config.block_size
        full = (seq.num_computed if computed is None else computed) // bs
        if not seq.cacheable or full <= seq.num_registered or not seq.block_table:
            return
        hashes = seq.block_hashes(full)
        for i in range(seq.num_registered, full):
            parent = seq.block_table[i - 1] if i else NO_PARENT
            self.blocks.register(seq.block_table[i], hashes[i], seq.tokens[i * bs : (i + 1) * bs],
                                 parent, self.weight_version, seq.cache_salt)  # fmt: skip
        seq.num_registered = full

    # -- scheduler callbacks ------------------------------------------------------------------
    def _on_admit(self, seq: Sequence, reused: int) -> None:
        self.blocks.stats.tokens_reused += reused
        req = seq.request
        if req.status == Status.WAITING_IN_QUEUE:  # the first admission: what the prompt reused
            req.cached_tokens = reused
            req.status = Status.ACTIVE_AND_GENERATING_TOKENS
            req.add_event_add_context()

    def _on_evict(self, seq: Sequence) -> None:
        seq.record.requests[-1].add_event_evict()
        seq.record.checkpoint()
        seq.request.status = Status.WAITING_IN_QUEUE

    # -- whole runs ---------------------------------------------------------------------------
    def generate(
        self, prompts: Seq[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[DynamicInferenceRequest]:
        """Run `prompts` to completion; merged requests in input order (failed ones included).
        If it raises, none of its requests is left behind in the engine."""
        ids: list[int] = []
        try:
            for p in prompts:
                ids.append(self.add_request(None, p, sampling_params).request_id)
            return self._run_to_completion(ids)
        except BaseException:
            for rid in ids:
                self.discard(rid)
            raise

    def _run_to_completion(self, ids: list[int]) -> list[DynamicInferenceRequest]:
        wanted = set(ids)
        results: dict[int, DynamicInferenceRequestRecord] = {}
        others: list[DynamicInferenceRequestRecord] = []  # someone else's: kept for step()
        try:
            while wanted - results.keys():
                out = self.step()
                for record in out.finished:
                    if record.request_id in wanted:
                        results[record.request_id] = record
                    else:
                        others.append(record)
                if not out.finished and not self.scheduler.running and not self.scheduler.waiting:
                    raise RuntimeError("engine stalled with requests outstanding")
        finally:
            self._done.extend(others)
        return [results[i].merge() for i in ids]

    # -- memory lifecycle ---------------------------------------------------------------------
    def suspend(self, mode: str = "persist") -> int:
        """Stop serving and free the KV memory per `mode`; returns the bytes of KV released
        from the device (0 for persist). Idempotent: a second call returns 0."""
        if mode not in SUSPEND_MODES:
            raise ValueError(f"suspend mode must be one of {SUSPEND_MODES}, got {mode!r}")
        if self.suspended is not None:
            return 0
        self._drain()  # its tokens carry the version that sampled them
        for seq in self.scheduler.running:
            seq.request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
            seq.request.add_event_pause()
        self.suspended = mode
        if mode == "persist":
            return 0
        if self.runner.graphs is not None:  # they hold the pool's address, and memory of their own
            self.runner.graphs.clear()
        if mode == "offload":
            return self.kv.offload()
        for seq in self.scheduler.running:  # recompute: each re-prefills on resume, in order
            self.blocks.free(seq.drop_kv())
        self.blocks.reset()
        return self.kv.drop()

    def resume(self) -> None:
        """Restore the KV pool after suspend() and serve again (no-op when not suspended)."""
        if self.closed:
            raise RuntimeError("engine is closed")
        if self.suspended is None:
            return
        self.suspended = None
        self.kv.restore()
        self.residency.restore()  # offloaded weights; discarded ones wait for an update
        for seq in self.scheduler.running:
            seq.request.status = Status.ACTIVE_AND_GENERATING_TOKENS

    def release_weights(self, mode: str) -> dict:
        """While suspended, free the weights too (vLLM's sleep: "offload" to host memory, back
        on resume; "discard", back with the next update, which must carry the whole model;
        rollout.engine.weights_residency). What happened and the bytes freed."""
        if self.suspended is None:
            raise RuntimeError("release_weights() needs a suspended engine: suspend() first")
        if self.runner.graphs is not None:  # they hold the weights' addresses
            self.runner.graphs.clear()
        out = self.residency.release(mode)
        if mode == "discard":  # the staging buffer holds a copy of some version too
            out["weights_bytes_freed"] += self.weight_stage.release()
        return out

    def wake(self) -> None:
        """No-op: an in-process step() never blocks waiting for work, so there is nothing to
        return early from (EngineProtocol: the cluster engine's step() waits)."""

    def close(self) -> None:
        """Forget every request and free the KV pool and any host copy of it; step() and
        resume() raise afterwards. Idempotent."""
        self._inflight = None
        for rid in list(self._seqs):
            self.discard(rid)
        self._done.clear()
        if self.runner.graphs is not None:
            self.runner.graphs.clear()
        self.kv.close()
        self.closed = True

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the model in place and stamp `version`.

        A new version is a whole model: every tensor of the model, each with its shape (a
        forgotten one would silently keep serving old weights), or with a LoRA adapter the whole
        adapter or the whole base (rollout.models.lora.update_scope); floating-point tensors cast to
        the model's dtype, others must match it.
        Anything wrong raises ValueError before a single weight changes. Then every in-flight
        request's staleness goes up by one (policy only for those without KV), the KV policy is
        applied, and prefix-cache blocks from older weights are dropped.
        """
        targets = self._check_update(state_dict, version)
        self.residency.check_covers(state_dict)
        self._drain()  # the in-flight tokens are the old version's
        self.residency.materialize()
        with torch.no_grad():
            for name, t in state_dict.items():
                targets[name].copy_(t)
        self._after_update(version)

    def flip_weights(self, staged: Staged) -> None:
        """Serve the version `stage_weights` staged, from the next step on: the weights swap
        with the buffer (a device-local copy while CUDA graphs hold the weights' addresses),
        then exactly what `update_weights` does after its copy. Call between two steps."""
        if staged is not self.weight_stage.staged or staged.version <= self.weight_version:
            raise ValueError(f"version {staged.version} is not the one staged for this engine "
                             f"(serving {self.weight_version})")  # fmt: skip
        self.residency.check_covers(staged.tensors)
        self._drain()  # the in-flight tokens are the old version's
        self.residency.materialize()  # a swap hands the old storage to the next stage
        self.weight_stage.flip(staged, swap=self.runner.graphs is None)
        self._after_update(staged.version)

    def _after_update(self, version: int) -> None:
        """New weights are in: stamp `version`, count the update against every in-flight
        request and apply the KV policy."""
        self.weight_version = version
        self.residency.loaded()
        self.counters["weight_updates"] += 1
        recompute = self.config.kv_policy == "recompute"
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            has_kv = bool(seq.block_table) and seq.num_computed > 0
            seq.record.increment_staleness(policy_only=not has_kv)
            if has_kv and recompute:
                self.blocks.free(seq.drop_kv())
            elif has_kv:
                seq.cacheable = False  # its KV mixes weights: never publish it
        self.blocks.drop_blocks_older_than(version)

    def stage_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        should_abort: Callable[[], bool] | None = None,
    ) -> Staged:
        """Check `state_dict` and copy it into the second buffer (rollout.engine.staging), while
        steps go on: safe from another thread, it reads no engine state but the weights'
        shapes. Flip with `flip_weights(staged)` between two steps, inside
        `weight_stage.hold()`. ValueError / StagingAborted leave nothing staged."""
        return self.weight_stage.stage(state_dict, version, self.weight_version, should_abort)

    def _check_update(
        self, state_dict: Mapping[str, torch.Tensor], version: int
    ) -> dict[str, torch.Tensor]:
        """The model's tensors `state_dict` loads into; ValueError naming every problem."""
        return check_update(self.model, state_dict, version, self.weight_version, "update_weights")

    # -- introspection (rollout.engine.introspection) ------------------------------------------
    def load(self) -> dict[str, Any]:
        return introspection.load(self)

    def stats(self) -> dict[str, Any]:
        return introspection.stats(self)
