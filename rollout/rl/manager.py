"""`RolloutManager`: the one object an RL trainer talks to.

It owns the engine and hands the trainer finished GRPO groups. Two modes:

- colocated (default): the trainer's thread drives the engine. resume -> collect a batch ->
  suspend (KV freed for the optimizer) -> train -> update_weights -> resume. Groups beyond the
  batch stay in flight as partial rollouts and continue after the update; the engine checkpoints
  their records and increments their staleness at the update.
- async: a background thread owns the engine and keeps generating while the trainer trains.
  Every call from the trainer (update_weights, suspend, ...) is a command the thread runs between
  two engine steps, so a weight swap can never land inside a forward pass (no sample mixes
  versions within one token), and no lock can starve the trainer (`rollout.rl.driver`).

The caller owns the prompt source: `collect` pulls prompts from the iterable it is given, only
while it runs, and only as many as may be in flight (`max_inflight_groups`). An iterator passed
to successive calls continues where the last call stopped; the groups submitted beyond a batch
stay in flight as partial rollouts (async mode tops them up before returning, so the engine
generates while the trainer trains).

Staleness is counted in weight updates and computed when a sample is handed out, from each
token's own weight versions (`rollout.rl.staleness`; definitions in docs/internals.md). `max_staleness`
bounds every handed-out token's policy and KV staleness: stale groups are dropped whole
(`stale_policy="drop"`; GRPO advantages need complete groups) or only their stale samples are
re-sampled (`"regenerate"`). Both are counted in `stats()`.

A request that fails (refused by the engine, lost with its engine, or caught in an engine step
that raised) becomes a failed sample (`Sample.failed`, `Sample.error`), counted under
`rollout/samples_failed` and logged; generation goes on. A batch in which more than
`max_failed_fraction` of the samples failed raises `BatchFailed` naming the reasons
(`rollout.rl.batch_health`), and an engine gone for good (dp > 1: the coordinator process died)
raises `EngineLost` from the call that waits on it, at once.

Multi-turn: `collect(..., env=factory)` and `generate(..., env=factory)` run one episode per
sample (`rollout.rl.episodes`): each source item is an example the environment starts from, and
each model turn is a request like any other, so episodes share the groups, the partial rollouts
across updates, the staleness bound and the failure handling above. A turn whose environment
answered while the engine was suspended waits for `resume()`.

Dynamic sampling (DAPO, `dynamic_sampling=True`): a group whose members all earned the same
reward carries no GRPO signal; it is dropped and another prompt drawn in its place, at most
`max_extra_groups` per batch. Past that bound the batch is filled with such groups (counted), so
a batch always has its size.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from rollout.engine.interface import EngineLost, EngineProtocol
from rollout.metrics import staleness_summary
from rollout.request import DynamicInferenceRequest
from rollout.rl.batch_health import check_batch
from rollout.rl.driver import EngineDriver
from rollout.rl.dynamic_sampling import DynamicSampling, RewardFn, assign_rewards
from rollout.rl.engines import manager_engine, max_sequence_length
from rollout.rl.environment import EnvFactory
from rollout.rl.episodes import EpisodeLimits, EpisodeRecord, EpisodeRunner
from rollout.rl.groups import Group, Result, hand_out, stale_indices
from rollout.rl.manager_config import RolloutManagerConfig
from rollout.rl.samples import Sample, request_error
from rollout.rl.sampling_policy import (
    check_n,
    resolve_sampling_params,
    sample_seeded,
    turn_seeded,
)
from rollout.rl.slots import Slot, failed_record, resolve
from rollout.rl.staleness import VersionHistory
from rollout.sampling import SamplingParams
from rollout.weights.state import as_state_dict

log = logging.getLogger(__name__)

__all__ = ["RolloutManager"]


class RolloutManager:
    """Generation for RL: collect GRPO groups, suspend/resume, versioned weight updates."""

    def __init__(
        self,
        config: RolloutManagerConfig | None = None,
        *,
        model: nn.Module | None = None,
        tokenizer: Any = None,
        inference_config: Any = None,
        engine: EngineProtocol | None = None,
        cluster_options: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        base = config if config is not None else RolloutManagerConfig()
        self.config = dataclasses.replace(base, **overrides) if overrides else base
        self._owns_engine = engine is None
        if engine is None:
            engine = manager_engine(
                self.config, model, tokenizer, inference_config, cluster_options
            )
        elif cluster_options:
            raise ValueError("cluster_options only apply with dp > 1 or launcher='ray'")
        self.engine: EngineProtocol = engine
        self.version = int(engine.weight_version)
        self._max_sequence_length = max_sequence_length(inference_config)
        self._groups: dict[int, Group] = {}
        self._requests: dict[int, Slot] = {}  # request id -> where its record goes
        self._deferred: list[Callable[[], None]] = []  # turns that arrived while suspended
        self._runner: EpisodeRunner | None = None  # started with the first episode
        self._episodes_running = 0
        self._ready: deque[int] = deque()
        self._next_rid = 0
        self._next_gid = 0
        self._history = VersionHistory(self.version)
        self._counters: dict[str, float] = dict.fromkeys(
            (
                "samples_out",
                "groups_out",
                "groups_dropped_stale",
                "samples_regenerated",
                "samples_failed",
                "engine_step_errors",
                "late_records",
                "tokens_generated",
                "engine_steps",
                "suspends",
                "kv_bytes_freed_total",
                "episodes_out",
                "episodes_failed",
                "turns",
                "groups_dropped_zero_variance",
                "groups_oversampled",
                "groups_filled_zero_variance",
            ),
            0,
        )
        self._last: dict[str, float] = {}
        self._driver = EngineDriver(  # async: starts the thread that owns the engine
            engine,
            self._step,
            self.config.collect_timeout_s,
            self.config.mode == "async",
            elsewhere=lambda: self._episodes_running > 0,
        )
        self._cv = self._driver.cv  # guards groups, requests and ready (shared with the driver)
        ref = weakref.ref(self)
        self._atexit = lambda: (m := ref()) is not None and m.close()
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Iterable[Any],
        n: int = 1,
        sampling_params: SamplingParams | None = None,
        *,
        env: EnvFactory | None = None,
    ) -> list[Sample]:
        """Generate n samples per prompt (episodes per example with `env`); returns them
        prompt-major, in input order."""
        sp = self._sampling_params(sampling_params)
        check_n(n)
        items = list(prompts)
        gids = self._driver.call(
            lambda: [self._submit_group(p, n, sp, for_collect=False, env=env) for p in items]
        )
        self._driver.wait(lambda: all(self._groups[g].complete for g in gids))
        with self._cv:
            out = [hand_out(self._groups.pop(g), self._history) for g in gids]
        return [s for grp in out for s in grp]

    def collect(
        self,
        prompt_source: Iterable[Any],
        batch_size_groups: int,
        n: int = 1,
        reward_fn: RewardFn | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        env: EnvFactory | None = None,
    ) -> list[Sample]:
        """Return `batch_size_groups` complete groups of n samples (group-contiguous, flat, in
        the order their prompts were pulled, whichever engine finished first).

        Prompts (str, token list, or a dict with "prompt" plus metadata handed to `reward_fn` via
        `sample.metadata`) are pulled from `prompt_source` while in-flight + ready groups are below
        the cap; pass the same iterator to every call to continue where the last one stopped. Groups
        still in flight from earlier calls come first. Fewer groups come back only when the
        source ends; an empty list means nothing is left.

        With `env` (an `EnvFactory`), each item is an episode's example and each sample one
        episode; its reward is the environment's unless `reward_fn` is given.
        """
        if batch_size_groups < 1:
            raise ValueError(f"batch_size_groups must be >= 1, got {batch_size_groups!r}")
        check_n(n)
        sp = self._sampling_params(sampling_params)
        if self._driver.closed:
            raise RuntimeError("RolloutManager is closed")
        if self.config.dynamic_sampling and reward_fn is None and env is None:
            raise ValueError("dynamic_sampling needs rewards: pass reward_fn (or env)")
        source, ended = iter(prompt_source), False
        cap = self._inflight_cap(batch_size_groups)
        batch: list[Sample] = []
        filter_ = DynamicSampling(self.config, batch_size_groups, self._counters)
        groups_needed = batch_size_groups
        while groups_needed:
            want = min(groups_needed, cap)  # never more than may be in flight
            with self._cv:
                short = len(self._ready) < want
            if short:  # a batch already waiting takes no new prompts
                ended = ended or self._top_up(source, n, sp, cap, env)
            self._driver.wait(lambda k=want, e=ended: len(self._ready) >= k or self._exhausted(e))
            with self._cv:
                take = [
                    self._groups.pop(self._ready.popleft())
                    for _ in range(min(groups_needed, len(self._ready)))
                ]
                for g in take:
                    fresh = self._filter_stale(g)
                    if fresh is None:
                        continue
                    assign_rewards(fresh, reward_fn)
                    if filter_.keep(fresh):
                        batch.extend(fresh)
                        groups_needed -= 1
                if not take and self._exhausted(ended):
                    break
        if self.config.mode == "async":  # the engine generates while the trainer trains
            self._top_up(source, n, sp, cap, env)
        batch.sort(key=lambda s: s.group_id)  # submission order, not finishing order (stable)
        self._last.update(  # the whole batch, not just its last group
            staleness_summary(
                [s.on_model_tokens(s.policy_staleness) for s in batch],
                kv=[s.on_model_tokens(s.kv_staleness) for s in batch],
                histograms=False,
            )
        )
        self._last.update(filter_.metrics())
        check_batch(batch, self.config.max_failed_fraction)
        return batch

    def suspend(self) -> int:
        """Free the KV pool for the optimizer (config.suspend_mode). Returns bytes freed."""
        return self._driver.call(self._do_suspend)

    def resume(self) -> None:
        self._driver.call(self._do_resume)

    def update_weights(
        self, source: nn.Module | Mapping[str, torch.Tensor], version: int | None = None
    ) -> int:
        """Push new weights into the engine; returns the new version (default: current + 1).

        Runs between engine steps. In-flight requests are checkpointed and their staleness
        incremented by the engine, which also applies the KV policy and drops stale prefix cache.
        With `InferenceConfig(weight_update="staged")` (in-process engine) the weights are first
        checked and copied into the engine's second buffer on this thread while the engine
        keeps generating; only the flip (rollout.engine.staging) runs between two steps.
        """
        new = self.version + 1 if version is None else int(version)
        if new <= self.version:
            raise ValueError(f"weight version must increase: got {new}, current {self.version}")
        sd = as_state_dict(source)
        stage = getattr(self.engine, "weight_stage", None)
        if stage is None or self.engine.config.weight_update != "staged":
            return self._driver.call(lambda: self._do_update(sd, new))
        with stage.hold():  # staged: received and checked here while the engine steps on
            staged = self.engine.stage_weights(sd, new)
            with self._cv:
                self._last["weight_sync/staging_seconds"] = staged.seconds
            flip = lambda: self.engine.flip_weights(staged)  # noqa: E731
            return self._driver.call(lambda: self._do_update(staged.tensors, new, flip))

    def stats(self) -> dict[str, float]:
        """Flat metrics under fixed namespaces (rollout/*, staleness/*, weight_sync/*, engine/*)."""
        with self._cv:
            inflight = sum(1 for g in self._groups.values() if not g.complete)
            out = {f"rollout/{k}": v for k, v in self._counters.items()}
            out.update(
                {
                    "rollout/version": self.version,
                    "rollout/num_updates": self._history.num_updates,
                    "rollout/inflight_groups": inflight,
                    "rollout/ready_groups": len(self._ready),
                    "rollout/inflight_requests": len(self._requests),
                    "rollout/suspended": int(self._driver.suspended),
                }
            )
            out.update(self._last)
        if not self._driver.closed:
            for k, v in self._driver.call(self.engine.stats).items():
                if isinstance(v, (int, float)):
                    out[k if "/" in k else f"engine/{k}"] = v
        return out

    def close(self) -> None:
        """Stop generating and release the engine; idempotent, safe from atexit."""
        if self._driver.closed:
            return
        self._driver.stop()
        if self._runner is not None:
            self._runner.close()
        for rid in list(self._requests):
            with contextlib.suppress(Exception):  # best effort at shutdown
                self.engine.abort(rid)
        self._requests.clear()
        self._groups.clear()
        self._ready.clear()
        atexit.unregister(self._atexit)
        if self._owns_engine:
            self.engine.close()  # engine processes and coordinator (dp > 1)

    def __enter__(self) -> RolloutManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._driver.closed

    @property
    def suspended(self) -> bool:
        return self._driver.suspended

    # ------------------------------------------------------------------ engine lifecycle

    def _do_suspend(self) -> int:
        if self._driver.suspended:
            return 0
        t0 = time.perf_counter()
        freed = int(self.engine.suspend(self.config.suspend_mode))
        self._driver.suspended = True
        self._counters["suspends"] += 1
        self._counters["kv_bytes_freed_total"] += freed
        self._last["engine/suspend_s"] = time.perf_counter() - t0
        self._last["engine/kv_bytes_freed"] = freed
        return freed

    def _do_resume(self) -> None:
        if not self._driver.suspended:
            return
        t0 = time.perf_counter()
        self.engine.resume()
        self._driver.suspended = False
        deferred, self._deferred = self._deferred, []
        for submit in deferred:  # episode turns whose environment answered meanwhile
            submit()
        self._last["engine/resume_s"] = time.perf_counter() - t0

    def _do_update(
        self, sd: dict[str, torch.Tensor], version: int, install: Callable[[], None] | None = None
    ) -> int:
        """Install `version` (`install`: the staged flip; default: update_weights(sd))."""
        if version <= self.version:
            raise ValueError(f"weight version must increase: got {version}, current {self.version}")
        t0 = time.perf_counter()
        if install is None:
            self.engine.update_weights(sd, version)
        else:
            install()
        dt = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        with self._cv:
            self.version = version
            self._history.append(version)
            self._last.update(
                {
                    "weight_sync/seconds": dt,
                    "weight_sync/bytes": nbytes,
                    "weight_sync/gbps": nbytes / max(dt, 1e-12) / 1e9,
                }
            )
        return version

    # ------------------------------------------------------------------ generation core

    def _sampling_params(self, sp: SamplingParams | None) -> SamplingParams:
        return resolve_sampling_params(self.config, sp)

    def _inflight_cap(self, batch_size_groups: int) -> int:
        cap = self.config.max_inflight_groups
        return int(cap) if cap is not None else 2 * batch_size_groups

    def _top_up(
        self, source: Iterator[Any], n: int, sp: SamplingParams, cap: int, env: EnvFactory | None
    ) -> bool:
        """Submit groups from `source` until in-flight + ready groups reach `cap`; True when
        `source` ran out. Nothing is pulled while suspended (the prompts would be lost)."""
        room = cap - self._num_collect_groups()
        if room <= 0 or self._driver.suspended:
            return False
        items = list(itertools.islice(source, room))
        if items:
            self._driver.call(lambda: [self._submit_group(it, n, sp, env=env) for it in items])
        return len(items) < room

    def _submit_group(
        self,
        item: Any,
        n: int,
        sp: SamplingParams,
        for_collect: bool = True,
        env: EnvFactory | None = None,
    ) -> int:
        if self._driver.suspended:
            raise RuntimeError("RolloutManager is suspended: call resume() before generating")
        prompt, meta = item, None
        if env is not None:  # the item is the episode's example, whatever its shape
            meta = item
        elif isinstance(item, Mapping):  # {"prompt": ..., "sampling_params": ..., **metadata}
            prompt = item.get("prompt")
            meta = {k: v for k, v in item.items() if k not in ("prompt", "sampling_params")}
            if item.get("sampling_params") is not None:
                sp = self._sampling_params(item["sampling_params"])
        if prompt is None:
            raise ValueError(f"prompt source item has no prompt: {item!r:.200}")
        gid = self._next_gid
        self._next_gid += 1
        g = Group(gid, prompt, meta, sp, [None] * n, for_collect, env)
        with self._cv:
            self._groups[gid] = g
        for i in range(n):
            self._submit_sample(g, i)
        return gid

    def _submit_sample(self, g: Group, index: int) -> None:
        if g.env is not None:
            self._start_episode(g, index)
            return
        sp = sample_seeded(g.sampling_params, g.gid, index, self._next_rid)
        self._add_request(g.prompt, sp, lambda req: self._file(g.gid, index, req))

    def _add_request(
        self,
        prompt: Any,
        sp: SamplingParams,
        deliver: Callable[[DynamicInferenceRequest], None],
        routing_key: str | None = None,
    ) -> int:
        """Put one request on the engine; its merged record goes to `deliver` (a refused one as
        a FAILED record)."""
        rid = self._next_rid
        self._next_rid += 1
        self._requests[rid] = Slot(prompt, deliver)
        try:
            self.engine.add_request(rid, prompt, sp, routing_key=routing_key)
        except EngineLost:
            raise
        except Exception as e:  # refused (bad prompt or parameters): this sample fails alone
            self._on_request(self._failed_request(rid, e))
        return rid

    # ------------------------------------------------------------------ episodes

    def _start_episode(self, g: Group, index: int) -> None:
        if self._runner is None:
            max_tokens = self.config.max_episode_tokens or self._max_sequence_length
            limits = EpisodeLimits(self.config.max_turns, max_tokens, self.config.env_timeout_s)
            self._runner = EpisodeRunner(self._submit_turn, limits)
        with self._cv:
            self._episodes_running += 1
        key = f"episode-{g.gid}-{index}-{self._next_rid}"
        self._runner.start(
            key, g.prompt, g.env, g.sampling_params, lambda ep: self._episode_done(g.gid, index, ep)
        )

    def _submit_turn(
        self, prompt: list[int], sp: SamplingParams, key: str
    ) -> asyncio.Future[DynamicInferenceRequest]:
        """On the environment loop: queue one model turn; resolves to its merged record."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[DynamicInferenceRequest] = loop.create_future()

        def deliver(req: DynamicInferenceRequest) -> None:
            loop.call_soon_threadsafe(resolve, fut, req)

        def submit() -> None:
            if self._driver.suspended:  # runs on resume: nothing is put on a suspended engine
                self._deferred.append(submit)
                return
            self._counters["turns"] += 1
            self._add_request(prompt, turn_seeded(sp, self._next_rid), deliver, routing_key=key)

        self._driver.submit(submit)
        return fut

    def _episode_done(self, gid: int, index: int, ep: EpisodeRecord) -> None:
        """On the environment loop: an episode ended (done, at a limit, or failed)."""
        with self._cv:
            self._episodes_running -= 1
            self._counters["episodes_out"] += 1
            if ep.failed():
                self._counters["episodes_failed"] += 1
            self._file(gid, index, ep)

    # ------------------------------------------------------------------ records

    def _step(self) -> None:
        try:
            out = self.engine.step()
        except EngineLost:
            raise  # nothing will come back: the caller hears it now (colocated: from collect)
        except Exception as e:  # no request explains it: fail the in-flight ones, keep going
            self._on_step_error(e)
            return
        self._counters["engine_steps"] += 1
        for record in out.finished:
            self._on_request(record.merge())

    def _on_step_error(self, error: Exception) -> None:
        """The engine step raised: every request in flight may be lost or corrupt, so each
        becomes a failed sample (aborted in the engine, best effort); later records for them
        are ignored."""
        self._counters["engine_step_errors"] += 1
        log.error(
            "engine step failed; failing %d in-flight requests: %r", len(self._requests), error
        )
        for rid in list(self._requests):
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
            self._on_request(self._failed_request(rid, error))

    def _failed_request(self, rid: int, error: Exception) -> DynamicInferenceRequest:
        return failed_record(rid, self._requests[rid].prompt, error)

    def _on_request(self, req: DynamicInferenceRequest) -> None:
        """A merged request came back (finished or failed): hand it to whoever waits for it."""
        slot = self._requests.pop(req.request_id, None)
        if slot is None:  # failed here already (a step error), or aborted at close
            self._counters["late_records"] += 1
            return
        self._counters["tokens_generated"] += len(req.generated_tokens)
        slot.deliver(req)

    def _file(self, gid: int, index: int, result: Result) -> None:
        """A member of group `gid` finished (a record or an episode): file it."""
        if result.failed():
            self._counters["samples_failed"] += 1
            n = self._counters["samples_failed"]
            if n <= 10 or n % 100 == 0:  # bounded log volume under a storm of failures
                why = result.error if isinstance(result, EpisodeRecord) else request_error(result)
                log.warning("sample %d of group %d failed (%d so far): %s", index, gid, n, why)
        with self._cv:
            g = self._groups.get(gid)
            if g is None:  # group dropped meanwhile
                return
            g.records[index] = result
            if g.complete and g.for_collect:
                self._ready.append(gid)
            self._cv.notify_all()

    def _filter_stale(self, g: Group) -> list[Sample] | None:
        """The group's samples as of now; None if it went back for regeneration or was dropped."""
        samples = hand_out(g, self._history)
        stale = stale_indices(samples, self.config.max_staleness)
        if not stale:
            return samples
        if self.config.stale_policy == "drop":
            self._counters["groups_dropped_stale"] += 1
            return None
        for i in stale:  # regenerate only the stale members; the group waits for them
            g.records[i] = None
            self._counters["samples_regenerated"] += 1
        self._groups[g.gid] = g
        self._driver.call_later(lambda: [self._submit_sample(g, i) for i in stale])
        return None

    def _exhausted(self, source_ended: bool) -> bool:
        """Nothing more can become ready: source ended, no collect group in flight (under `_cv`)."""
        return source_ended and not any(
            g.for_collect and not g.complete for g in self._groups.values()
        )

    def _num_collect_groups(self) -> int:
        with self._cv:
            return sum(1 for g in self._groups.values() if g.for_collect)
