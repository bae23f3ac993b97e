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

Beside this class: `intake` (a submission checked and made a Sequence), `postprocess` (what
each request takes from a forward), `overlap` (async scheduling), `lifecycle` (suspend, resume,
weight updates), `errors`, `introspection`.
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

from rollout.engine import grammar, introspection, lifecycle, sampler
from rollout.engine.block_manager import BlockManager
from rollout.engine.config import InferenceConfig
from rollout.engine.cuda_graphs import DecodeGraphs
from rollout.engine.errors import EngineBrokenError, RequestError, RequestFault
from rollout.engine.intake import Prompt, new_record, sequence_for
from rollout.engine.interface import StepOutput
from rollout.engine.kv_pool import KVPool
from rollout.engine.model_runner import ModelRunner, prepare_batch, serving_model
from rollout.engine.overlap import InFlight, drain, follow, sample_on_device
from rollout.engine.postprocess import complete, prompt_log_probs, register_blocks, sample
from rollout.engine.routing import RoutingRecorder
from rollout.engine.scheduler import ScheduledBatch, Scheduler
from rollout.engine.sequence import Sequence, check_block_hashes
from rollout.engine.staging import Staged, WeightStage
from rollout.engine.weights_residency import WeightsResidency
from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord, Status
from rollout.sampling import SamplingParams
from rollout.tokenizers import detokenize_with, eos_ids_of

MAX_STEP_FAILURES_IN_A_ROW = 3  # then the device, not a request, is at fault
log = logging.getLogger(__name__)


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
        self.model, device, dtype = serving_model(model, config)
        self.model_config = self.model.config
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
            seq = sequence_for(self, record, given)  # checks, seed, processors, grammar
        except RequestError as e:
            self._fail(record, e)
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
        drain(self)
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        complete(self, seq, "abort")
        return True

    def discard(self, request_id: int) -> None:
        """Forget a request without a record: its owner has given it to someone else (a
        coordinator that re-dispatched it) or is gone, so no reply may ever come out of here.
        Its blocks are freed."""
        drain(self)
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
            if not follow(self, out):
                drain(self, out)
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
                self._isolated(seq, "prefix-cache registration", register_blocks, self, seq)
        for item in prep.prompt_lp:
            self._isolated(item[0], "prompt log-probs", prompt_log_probs, item, logits)
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
                    self._inflight = InFlight(prep.samplers, sample_on_device(
                        prep.samplers, logits, [len(s.tokens) for s in prep.samplers]))  # fmt: skip
                    return
                except Exception:  # sampled again below, row by row where a row is at fault
                    log.debug("device-side sampling failed; sampling synchronously", exc_info=True)
            sample(self, prep.samplers, logits, out)

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

    # -- lifecycle (rollout.engine.lifecycle) --------------------------------------------------
    def suspend(self, mode: str = "persist") -> int:
        """Stop serving and free the KV memory per `mode`; returns the bytes of KV released
        from the device (0 for persist). Idempotent: a second call returns 0."""
        return lifecycle.suspend(self, mode)

    def resume(self) -> None:
        """Restore the KV pool after suspend() and serve again (no-op when not suspended)."""
        lifecycle.resume(self)

    def release_weights(self, mode: str) -> dict:
        """While suspended, free the weights too (vLLM's sleep: "offload" to host memory, back
        on resume; "discard", back with the next update, which must carry the whole model;
        rollout.engine.weights_residency). What happened and the bytes freed."""
        return lifecycle.release_weights(self, mode)

    def wake(self) -> None:
        """No-op: an in-process step() never blocks waiting for work, so there is nothing to
        return early from (EngineProtocol: the cluster engine's step() waits)."""

    def close(self) -> None:
        """Forget every request and free the KV pool and any host copy of it; step() and
        resume() raise afterwards. Idempotent."""
        lifecycle.close(self)

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
        lifecycle.update_weights(self, state_dict, version)

    def flip_weights(self, staged: Staged) -> None:
        """Serve the version `stage_weights` staged, from the next step on: the weights swap
        with the buffer (a device-local copy while CUDA graphs hold the weights' addresses),
        then exactly what `update_weights` does after its copy. Call between two steps."""
        lifecycle.flip_weights(self, staged)

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

    # -- introspection (rollout.engine.introspection) ------------------------------------------
    def load(self) -> dict[str, Any]:
        return introspection.load(self)

    def stats(self) -> dict[str, Any]:
        return introspection.stats(self)
