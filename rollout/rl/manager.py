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
import secrets
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from rollout.engine.config import InferenceConfig
from rollout.engine.engine import DynamicInferenceEngine
from rollout.engine.interface import EngineLost, EngineProtocol
from rollout.engine.logits_processors import processors_of
from rollout.metrics import staleness_summary
from rollout.protocol import SUSPEND_MODES
from rollout.request import DynamicInferenceRequest
from rollout.rl.batch_health import check_batch
from rollout.rl.driver import EngineDriver
from rollout.rl.environment import EnvFactory
from rollout.rl.episodes import EpisodeLimits, EpisodeRecord, EpisodeRunner
from rollout.rl.groups import Group, Result, hand_out, stale_indices, zero_variance
from rollout.rl.samples import Sample, request_error
from rollout.rl.staleness import VersionHistory
from rollout.sampling import LOGPROBS_MODES, SamplingParams
from rollout.serving.cluster import EngineCluster
from rollout.serving.cluster_engine import ClusterEngine
from rollout.weights.state import as_state_dict

log = logging.getLogger(__name__)

__all__ = ["RolloutManager", "RolloutManagerConfig"]

MODES = ("colocated", "async")
# EngineCluster options that mean something when attaching (the rest configure spawned engines)
_ATTACH_OPTIONS = ("auth_token", "weight_sync_host", "bucket_bytes", "ready_timeout_s",
                   "sync_timeout_s", "worker_options", "on_event", "weights_snapshot")  # fmt: skip
STALE_POLICIES = ("drop", "regenerate")


def _on_ray(options: Mapping[str, Any] | None) -> bool:
    """cluster_options asking for the ray launcher: engines on Ray whatever dp is."""
    return bool(options) and options.get("launcher") == "ray"


RewardFn = Callable[[Sample], Any]


@dataclasses.dataclass
class RolloutManagerConfig:
    """What the manager decides (engine sizes live in InferenceConfig).

    max_inflight_groups bounds groups submitted but not yet handed out (in flight + ready);
    None means 2 x the batch size, so a full batch leaves partial rollouts behind (set it to the
    batch size for strictly synchronous batches).
    """

    mode: str = "colocated"
    max_staleness: int | None = None
    stale_policy: str = "drop"
    suspend_mode: str = "recompute"
    max_inflight_groups: int | None = None
    initial_version: int = 0
    collect_timeout_s: float = 3600.0
    dp: int = 1  # engines: 1 = one in-process engine, > 1 = engine processes (EngineCluster)
    # "tcp://HOST:PORT": attach to a running coordinator and the engines that joined it (any
    # host) instead of starting engines; `dp` is then how many must have joined to start
    coordinator_address: str | None = None
    max_turns: int = 8  # episodes: model turns
    max_episode_tokens: int | None = None  # episodes: all tokens; None = the engine's limit
    env_timeout_s: float = 60.0  # episodes: one Environment.reset/step call
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    max_extra_groups: int | None = None  # dynamic sampling: extra groups per batch; None = batch
    # Behaviour log-probs of every request: processed = log_softmax(logits / T), what was
    # sampled from (TRL/veRL's convention: the IS ratio is exact at T != 1); raw = T 1.
    logprobs_mode: str = "processed"
    # a batch with more failed samples than this fraction raises BatchFailed (1.0: never)
    max_failed_fraction: float = 0.5
    # MoE: record every token's experts for the trainer to replay (SamplingParams
    # .return_routed_experts on every request; docs/internals.md, "Routing replay")
    routing_replay: bool = False
    # Logits processors (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens)
    # change the distribution tokens are drawn from; a trainer's log_softmax(logits / T) does
    # not. Refused unless True: the trainer then recomputes the processed logits itself
    # (rollout.engine.logits_processors.process) or accepts the mismatch.
    allow_logits_processors: bool = False

    def __post_init__(self) -> None:
        for name in ("routing_replay", "allow_logits_processors"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp must be an int >= 1, got {self.dp!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(
                f"stale_policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}"
            )
        if self.suspend_mode not in SUSPEND_MODES:
            raise ValueError(
                f"suspend_mode must be one of {SUSPEND_MODES}, got {self.suspend_mode!r}"
            )
        if self.max_staleness is not None and (
            isinstance(self.max_staleness, bool) or int(self.max_staleness) < 0
        ):
            raise ValueError(f"max_staleness must be None or >= 0, got {self.max_staleness!r}")
        if self.max_inflight_groups is not None and int(self.max_inflight_groups) < 1:
            raise ValueError(f"max_inflight_groups must be >= 1, got {self.max_inflight_groups!r}")
        if self.collect_timeout_s <= 0:
            raise ValueError(f"collect_timeout_s must be > 0, got {self.collect_timeout_s!r}")
        for name in ("max_turns", "max_episode_tokens", "max_extra_groups"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_extra_groups" else 1)):  # fmt: skip
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_turns is None:
            raise ValueError("max_turns must be a positive int, got None")
        if self.env_timeout_s <= 0:
            raise ValueError(f"env_timeout_s must be > 0, got {self.env_timeout_s!r}")
        frac = self.max_failed_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac <= 1:
            raise ValueError(f"max_failed_fraction must be a number in [0, 1], got {frac!r}")


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
        if engine is None and self.config.coordinator_address is not None:
            engine = self._attach(tokenizer, cluster_options)
        elif engine is None and (self.config.dp > 1 or _on_ray(cluster_options)):
            engine = self._start_cluster(model, tokenizer, inference_config, cluster_options)
        elif cluster_options:
            raise ValueError("cluster_options only apply with dp > 1 or launcher='ray'")
        if engine is None:
            if model is None:
                raise ValueError("RolloutManager needs a model (and tokenizer) or an engine")
            engine = DynamicInferenceEngine(
                model, tokenizer, inference_config or InferenceConfig(), self.config.initial_version
            )
        self.engine: EngineProtocol = engine
        self.version = int(engine.weight_version)
        self._max_sequence_length = _max_sequence_length(inference_config)
        self._groups: dict[int, Group] = {}
        self._requests: dict[int, _Slot] = {}  # request id -> where its record goes
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

    def _start_cluster(self, model: Any, tokenizer: Any, icfg: Any, options: Any) -> ClusterEngine:
        """dp > 1: a coordinator and `dp` engine processes loading `model`'s weights."""
        if model is None:
            raise ValueError("RolloutManager with dp > 1 needs model= (module, state_dict, "
                             "preset name or HF directory)")  # fmt: skip
        opts = dict(options or {})
        if icfg is not None:
            opts["inference_config"] = icfg
        cluster = EngineCluster(self.config.dp, model, tokenizer=tokenizer, **opts)
        cluster.factory_kwargs["weight_version"] = self.config.initial_version
        return ClusterEngine(cluster.start())

    def _attach(self, tokenizer: Any, options: Any) -> ClusterEngine:
        """Engines that run elsewhere, behind the coordinator at `coordinator_address`."""
        opts = {k: v for k, v in dict(options or {}).items() if k in _ATTACH_OPTIONS}
        cluster = EngineCluster(self.config.dp, None, tokenizer=tokenizer,
                                attach=self.config.coordinator_address, **opts)  # fmt: skip
        return ClusterEngine(cluster.start())

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
        _check_n(n)
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
        """Return `batch_size_groups` complete groups of n samples (group-contiguous, flat).

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
        _check_n(n)
        sp = self._sampling_params(sampling_params)
        if self._driver.closed:
            raise RuntimeError("RolloutManager is closed")
        if self.config.dynamic_sampling and reward_fn is None and env is None:
            raise ValueError("dynamic_sampling needs rewards: pass reward_fn (or env)")
        source, ended = iter(prompt_source), False
        cap = self._inflight_cap(batch_size_groups)
        batch: list[Sample] = []
        filter_ = _DynamicSampling(self.config, batch_size_groups, self._counters)
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
                    _assign_rewards(fresh, reward_fn)
                    if filter_.keep(fresh):
                        batch.extend(fresh)
                        groups_needed -= 1
                if not take and self._exhausted(ended):
                    break
        if self.config.mode == "async":  # the engine generates while the trainer trains
            self._top_up(source, n, sp, cap, env)
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
        sp = sp if sp is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        mode = self.config.logprobs_mode
        if sp.logprobs_mode not in (None, mode):  # one mode per run: the loss recomputes one
            raise ValueError(
                f"sampling_params.logprobs_mode={sp.logprobs_mode!r} differs from the manager's "
                f"logprobs_mode={mode!r}; leave it None or configure the manager"
            )
        reshaping = processors_of(sp) + (["structured_outputs"] if sp.structured_outputs else [])
        if reshaping and not self.config.allow_logits_processors:
            raise ValueError(
                f"sampling_params.{reshaping[0]} reshapes the logits the tokens are "
                "sampled from, which the trainer's log-prob recompute (log_softmax(logits / T)) "
                "does not reproduce; set RolloutManagerConfig.allow_logits_processors=True and "
                "recompute with rollout.engine.logits_processors.process, or leave it unset"
            )
        if self.config.routing_replay and not sp.return_routed_experts:
            sp = sp.replace(return_routed_experts=True)
        if sp.return_log_probs and sp.logprobs_mode == mode:
            return sp
        return sp.replace(return_log_probs=True, logprobs_mode=mode)

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
        sp = g.sampling_params
        if sp.seed is not None:  # distinct, reproducible streams per sample
            salt = g.gid * 1009 + index * 7919 + self._next_rid
            sp = sp.replace(seed=(sp.seed * 1_000_003 + salt) % 2**31)
        elif (
            not sp.is_greedy
        ):  # a known stream: re-dispatch keeps it, `rollout.rl.replay` reruns it
            sp = sp.replace(seed=secrets.randbelow(2**31))
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
        self._requests[rid] = _Slot(prompt, deliver)
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
            loop.call_soon_threadsafe(_resolve, fut, req)

        def submit() -> None:
            if self._driver.suspended:  # runs on resume: nothing is put on a suspended engine
                self._deferred.append(submit)
                return
            self._counters["turns"] += 1
            turn_sp = sp
            if sp.seed is not None:  # each turn its own reproducible stream
                turn_sp = sp.replace(seed=(sp.seed * 1_000_003 + self._next_rid * 7919) % 2**31)
            self._add_request(prompt, turn_sp, deliver, routing_key=key)

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
        """A FAILED record for request `rid` (its prompt kept when it is a prompt)."""
        prompt = self._requests[rid].prompt
        text = prompt if isinstance(prompt, str) else None
        tokens = None
        with contextlib.suppress(ValueError, TypeError):  # a prompt the engine could not take
            tokens = None if prompt is None or text is not None else torch.as_tensor(prompt)
        req = DynamicInferenceRequest(rid, prompt=text)
        if tokens is not None and tokens.dim() == 1 and not tokens.is_floating_point():
            req.prompt_tokens = tokens.to(torch.int64)
        req.mark_failed(error)
        return req

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


@dataclasses.dataclass
class _Slot:
    """An engine request the manager waits for: its prompt (for a FAILED record) and who gets
    its merged record (a group member, or an episode's turn)."""

    prompt: Any
    deliver: Callable[[DynamicInferenceRequest], None]


def _resolve(fut: asyncio.Future, req: DynamicInferenceRequest) -> None:
    if not fut.done():
        fut.set_result(req)


def _assign_rewards(samples: list[Sample], reward_fn: RewardFn | None) -> None:
    if reward_fn is not None:
        for s in samples:
            s.reward = reward_fn(s)


class _DynamicSampling:
    """One batch's dynamic-sampling decisions (DAPO): drop zero-variance groups while the
    extra-group budget lasts, then keep them (the batch keeps its size)."""

    def __init__(self, config: RolloutManagerConfig, batch_groups: int, counters: dict) -> None:
        self.on = config.dynamic_sampling
        extra = config.max_extra_groups
        self.budget = batch_groups if extra is None else extra
        self.counters = counters
        self.kept = self.dropped = self.filled = 0

    def keep(self, samples: list[Sample]) -> bool:
        flat = zero_variance(samples)
        if self.on and flat and self.dropped < self.budget:
            self.dropped += 1
            self.counters["groups_dropped_zero_variance"] += 1
            self.counters["groups_oversampled"] += 1
            return False
        if self.on and flat:
            self.filled += 1
            self.counters["groups_filled_zero_variance"] += 1
        self.kept += 1
        self.counters["groups_out"] += 1
        self.counters["samples_out"] += len(samples)
        return True

    def metrics(self) -> dict[str, float]:
        if not self.on:
            return {}
        return {
            "rollout/dynamic_sampling/kept": self.kept - self.filled,
            "rollout/dynamic_sampling/dropped": self.dropped,
            "rollout/dynamic_sampling/oversampled": self.dropped,
            "rollout/dynamic_sampling/filled": self.filled,
        }


def _max_sequence_length(icfg: InferenceConfig | Mapping[str, Any] | None) -> int:
    """The engines' longest sequence: the default bound on an episode's tokens."""
    if isinstance(icfg, Mapping):
        return int(icfg.get("max_sequence_length", InferenceConfig.max_sequence_length))
    return (icfg or InferenceConfig()).max_sequence_length


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an int >= 1, got {n!r}")
