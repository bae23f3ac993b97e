"""The one lifecycle under vLLM's, SGLang's and AReaL's control routes.

Each foreign route (vllm_control.py, sglang_routes.py, areal_routes.py) is a thin translation
onto these calls, which use only our acknowledged controls (each returns once every engine
acked) and the trainer's weight path:

- pause: `keep` holds requests in the engines (PAUSE; they carry across the next update with
  exact staleness); `abort` and `wait` hold new requests here while those in flight are aborted
  (their callers get what was generated, finish_reason "abort") or finish, then pause;
- sleep (vLLM's levels; `tags` picks weights and/or kv_cache, default both): pause, then SUSPEND
  with the KV pool offloaded to host memory (level 1) or dropped, its requests re-prefilled on
  wake (level 2), and the weights offloaded to host memory (level 1; a CPU engine's are there
  already: nothing moves) or discarded (level 2; rollout.engine.weights_residency). Discarded
  weights come back only with the next weight update: until one has landed no engine computes,
  requests already admitted stay held (their tokens are never computed on freed memory), and a
  new request is refused with 409 `weights_discarded`. `wake_up(kv_cache)` (or no tags) is
  RESUME, which also brings offloaded weights back; `wake_up(weights)` alone changes nothing in
  the engines (the update allocates and fills the weights), so a colocated trainer's "sleep 2,
  wake weights, update, wake KV" works as in vLLM;
- reset of the prefix cache: SUSPEND(recompute) then RESUME (drops every cached block; running
  requests re-prefill under the same weights, so their tokens do not change);
- weights from a folder or from a trainer's process group: read and checked here against the
  served model (rollout.weights.folder_update, the engines' own check) before anything is sent,
  then pushed by the trainer path (an attached `EngineCluster`: MACed announcement, digest
  agreement, all-or-nothing per engine) as the next version. A folder that fails a check leaves
  the served version as it was.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import torch

from rollout.serving.client_errors import ControlError
from rollout.serving.http.schemas import APIError, bad_request
from rollout.serving.http.weight_group import WeightGroup
from rollout.weights.broadcast import WeightSyncError
from rollout.weights.folder_update import checked_state_dict, read_folder, shapes_of

log = logging.getLogger(__name__)

PAUSE_MODES = ("keep", "abort", "wait")
SLEEP_MODES = {1: "offload", 2: "recompute"}  # vLLM sleep level -> our SUSPEND mode
WEIGHT_SLEEP = {1: "offload", 2: "discard"}  # vLLM sleep level -> SUSPEND's weights
TAGS = ("weights", "kv_cache")
ABORT_WAIT_S = 60.0  # aborted requests answer within a step; bounded all the same


class Control:
    """Lifecycle state the foreign routes share, on the app's client (one event loop)."""

    def __init__(self, be: Any, address: str, auth_token: str | None,
                 model_source: str | None) -> None:  # fmt: skip
        self.be = be
        self.address, self.auth_token, self.model_source = address, auth_token, model_source
        self.paused = False  # by a caller: /pause, /pause_generation, ...
        self.sleeping = 0  # the sleep level while asleep
        self.weights_missing = False  # discarded by sleep(level=2) and not updated since
        self.draining = False  # pause(wait): new requests wait here
        self._admit = asyncio.Event()
        self._admit.set()
        self.lock = asyncio.Lock()  # one control sequence at a time
        self._pusher: Any = None  # the attached EngineCluster that pushes weights
        self._shapes: Any = None
        self.updates = 0
        self.groups: dict[str, WeightGroup] = {}  # trainers' weight groups this server joined
        self.partial: dict[str, torch.Tensor] = {}  # group tensors of a version not yet whole

    # ---- requests ---------------------------------------------------------------------------

    async def admitted(self) -> None:
        """Returns once new requests may go to the engines (at once unless pause(wait) drains)."""
        await self._admit.wait()

    def check_weights(self) -> None:
        """409 for a new request while awake with discarded weights (asleep, it is held)."""
        if self.weights_missing and not self.sleeping:
            raise APIError(409, "the weights were discarded by /sleep level 2 and no weight "
                                "update has arrived since: load weights (POST /update_weights "
                                "{\"weight_dir\"}, /update_weights_from_disk, a weight group) "
                                "before generating", code="weights_discarded")  # fmt: skip

    def _in_flight(self) -> list[asyncio.Future]:
        return self.be.client.in_flight()

    # ---- pause / resume ---------------------------------------------------------------------

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        if mode not in PAUSE_MODES:
            raise bad_request(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", "mode")
        async with self.lock:
            if mode == "keep":
                await self._ack(self.be.client.pause_engines())
            else:  # new requests wait here while those in flight finish (or are aborted)
                self.draining = True
                self._admit.clear()
                try:
                    futures = self._in_flight()
                    if mode == "abort":
                        for f in futures:
                            self.be.client.abort(f)
                    if futures:  # their callers have their answers before this returns
                        await asyncio.wait(
                            futures, timeout=ABORT_WAIT_S if mode == "abort" else None
                        )
                    await self._ack(self.be.client.pause_engines())
                finally:
                    self.draining = False
                    self._admit.set()
            self.paused = True
            if clear_cache:
                await self._reset_cache()

    async def resume(self) -> None:
        async with self.lock:
            self.paused = False
            if not self.sleeping:
                await self._ack(self.be.client.unpause_engines())

    # ---- sleep / wake -----------------------------------------------------------------------

    async def sleep(self, level: int = 1, tags: list[str] | None = None) -> dict:
        """Free what `tags` names (default both) per `level`; the bytes each part freed."""
        if level not in SLEEP_MODES:
            raise bad_request(f"level must be one of {sorted(SLEEP_MODES)}, got {level!r}", "level")
        check_tags(tags)
        kv = SLEEP_MODES[level] if tags is None or "kv_cache" in tags else "persist"
        weights = WEIGHT_SLEEP[level] if tags is None or "weights" in tags else "keep"
        async with self.lock:
            await self._ack(self.be.client.pause_engines())
            acks = await self._ack(self.be.client.suspend_engines(kv, weights))
            self.sleeping = self.sleeping or level
            infos = [a for a in acks.values() if isinstance(a, dict)]
            states = sorted({str(a.get("weights", "resident")) for a in infos})
            self.weights_missing = self.weights_missing or "discarded" in states
        return {"level": level,
                "kv_cache_bytes_freed": sum(int(a.get("bytes_freed", 0)) for a in infos),
                "weights_bytes_freed": sum(int(a.get("weights_bytes_freed", 0)) for a in infos),
                "weights": states[0] if len(states) == 1 else states}  # fmt: skip

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """tags None or with "kv_cache": serve again (unless paused by a caller), offloaded
        weights back too; ["weights"] alone: nothing to do in the engines (discarded weights
        come back with the next update, which allocates them; the module docstring)."""
        check_tags(tags)
        if tags is not None and "kv_cache" not in tags:
            return
        async with self.lock:
            await self._ack(self.be.client.resume_engines())
            self.sleeping = 0
            if not self.paused:
                await self._ack(self.be.client.unpause_engines())

    # ---- prefix cache -----------------------------------------------------------------------

    async def reset_cache(self) -> None:
        async with self.lock:
            await self._reset_cache()

    async def _reset_cache(self) -> None:
        if self.sleeping == 2:
            return  # dropped when it went to sleep
        if self.sleeping:
            raise APIError(409, "the prefix cache is offloaded (sleep level 1): wake_up first",
                           code="sleeping")  # fmt: skip
        c = self.be.client
        running = (await c.stats())["state"] == "RUNNING"  # a trainer's pause stays
        await self._ack(c.pause_engines())
        await self._ack(c.suspend_engines("recompute"))
        await self._ack(c.resume_engines())
        if running:
            await self._ack(c.unpause_engines())

    # ---- weights ----------------------------------------------------------------------------

    async def weight_version(self) -> int:
        stats = await self.be.client.stats()
        if stats.get("weight_version") is not None:
            return int(stats["weight_version"])
        versions = [int(e["weight_version"] or 0) for e in stats["engines"].values()]
        return max(versions, default=0)

    async def update_from_folder(self, path: Any, param: str, version: int | None = None) -> int:
        """Load `path` (the request's field `param`) as the next version (or `version`)."""
        if not isinstance(path, str) or not path:
            raise bad_request(f"{param} must be a folder path", param)
        try:
            tensors = await asyncio.to_thread(read_folder, Path(path))
        except (OSError, ValueError) as e:
            raise bad_request(f"{param}: {e}", param) from None
        return await self.update_from_tensors(tensors, param, version)

    async def update_from_tensors(self, tensors: dict[str, torch.Tensor], param: str,
                                  version: int | None = None) -> int:  # fmt: skip
        async with self.lock:
            current = await self.weight_version()
            version = current + 1 if version is None else version
            try:
                sd = checked_state_dict(await self.model_shapes(), tensors, version, current)
            except ValueError as e:
                raise bad_request(f"{param}: {e}; the served version {current} is unchanged",
                                  param) from None  # fmt: skip
            try:
                await asyncio.to_thread(self._push, sd, version)
            except WeightSyncError as e:
                raise APIError(500, f"weight update to version {version} failed, every engine "
                                    f"still serves its previous version: {e}", "server_error",
                               code="weight_update_failed") from None  # fmt: skip
            self.updates += 1
            self.weights_missing = False  # every engine applied a whole model
            return version

    async def model_shapes(self) -> Any:
        if self._shapes is None:
            if self.model_source is None:
                raise APIError(501, "this server was started without its model source: weight "
                                    "updates need `rollout serve`", code="not_supported")  # fmt: skip
            tok = self.be.tokenizer
            vocab = getattr(tok, "vocab_size", None)
            self._shapes = await asyncio.to_thread(shapes_of, self.model_source, vocab)
        return self._shapes

    def _push(self, sd: dict[str, torch.Tensor], version: int) -> None:
        """The trainer path (a thread: it blocks on the transfer)."""
        if self._pusher is None:
            from rollout.serving.cluster import EngineCluster  # a trainer's side, made once

            # one registered engine suffices to start; every serving engine gets each update
            pusher = EngineCluster(1, attach=self.address, auth_token=self.auth_token,
                                   weight_sync=True, weights_snapshot="memory",
                                   ready_timeout_s=60.0)  # fmt: skip
            self._pusher = pusher.start()
        self._pusher.update_weights(sd, version)

    # ---- weights over a trainer's process group ------------------------------------------------

    async def join_group(self, args: tuple) -> None:
        """Join the trainer's group (it joins at the same time: blocks until all have)."""
        name = args[4]
        if name in self.groups:
            raise bad_request(f"group {name!r} exists: destroy it first", "group_name")
        try:
            self.groups[name] = await asyncio.to_thread(WeightGroup, *args)
        except (RuntimeError, ValueError, OSError) as e:  # torch's rendezvous / gloo errors
            raise APIError(502, f"could not join weight group {name!r}: {e}",
                           code="group_failed") from None  # fmt: skip

    async def leave_group(self, name: Any) -> None:
        group = self.groups.pop(name, None) if isinstance(name, str) else None
        if group is None:
            raise bad_request(f"no weight group named {name!r}", "group_name")
        await asyncio.to_thread(group.close)

    async def receive_from_group(self, name: Any, meta: tuple, version: int | None) -> int | None:
        """Receive `meta`'s tensors (names, dtypes, shapes) over group `name`. The served
        version moves once the tensors received since the last one make a whole model (a
        trainer sends buckets); the new version then, else None."""
        group = self.groups.get(name) if isinstance(name, str) else None
        if group is None:
            raise bad_request(f"no weight group named {name!r}: init it first", "group_name")
        try:
            got = await asyncio.to_thread(group.receive, *meta)
        except (RuntimeError, ValueError) as e:
            self.groups.pop(name, None)
            self.partial.clear()
            raise APIError(502, f"receiving over weight group {name!r} failed (group dropped): "
                                f"{e}", code="group_failed") from None  # fmt: skip
        self.partial.update(got)
        shapes = await self.model_shapes()
        try:
            checked_state_dict(shapes, dict(self.partial), 1 << 62, 0)
        except ValueError as e:
            problems = str(e).removeprefix("incompatible weights: ").split("; ")
            if all(p.startswith("missing tensors") for p in problems):
                return None  # more buckets to come
            self.partial.clear()
            raise bad_request(f"names: {e}; the served version is unchanged", "names") from None
        tensors, self.partial = self.partial, {}
        return await self.update_from_tensors(tensors, "names", version)

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        if self._pusher is not None:
            self._pusher.close()
            self._pusher = None

    # ---- state ------------------------------------------------------------------------------

    async def _ack(self, fut: asyncio.Future) -> dict:
        """An acknowledged control; a refused transition is the caller's 409."""
        try:
            return await asyncio.wait_for(fut, 300.0)
        except ControlError as e:
            raise APIError(409, str(e), code="invalid_state") from None


def check_tags(tags: list[str] | None) -> None:
    if tags is None:
        return
    if unknown := [t for t in tags if t not in TAGS]:
        raise bad_request(f"tags must be among {list(TAGS)}, got {unknown[0]!r}", "tags")
