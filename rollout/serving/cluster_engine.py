"""`ClusterEngine`: the engine protocol RolloutManager drives, over an `EngineCluster`."""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollout.engine.interface import EngineLost, StepOutput
from rollout.request import DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams
from rollout.serving.cluster import EngineCluster
from rollout.serving.replies import failed_record

_WAKE = object()


class ClusterEngine:
    """`rollout.engine.interface.EngineProtocol` backed by an EngineCluster: the RolloutManager
    drives N engine processes exactly as it drives one in-process engine.

    `step()` blocks (up to `step_timeout_s`, or until `wake()`) for finished records instead of
    computing: the engines run on their own. Records come back with the caller's request ids.
    Per-token weight versions are stamped by the engines themselves; prefix caches and their
    evictions are the engines' and the coordinator's business (`pop_evicted_hashes` is empty).
    `tokenizer` is the engines' (text prompts are tokenized in the engine processes).
    When the cluster's coordinator dies, `step()` and `add_request()` raise `EngineLost` at once.
    """

    model = None  # weights live in other processes; they validate every update themselves

    def __init__(
        self, cluster: EngineCluster, step_timeout_s: float = 0.5, tokenizer: Any = None
    ) -> None:
        self.cluster = cluster
        self.step_timeout_s = step_timeout_s
        self.tokenizer = tokenizer
        self.weight_version = int(cluster.factory_kwargs.get("weight_version", 0))
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[int, Any] = {}  # touched on the loop thread only
        self._pending = 0
        self._discarded: set[int] = set()  # their records are dropped when they come back
        self.last_sync: dict[int, dict] = {}
        self.client_request_ids: dict[int, int] = {}  # ours -> the client's (schedule logs)
        cluster.lost_callbacks.append(self.wake)  # a step waiting for records hears it at once

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: int,
        prompt: Any = None,
        sampling_params: SamplingParams | None = None,
        record: DynamicInferenceRequestRecord | None = None,
        precomputed_block_hashes: Sequence[int] | None = None,  # the coordinator hashes
        routing_key: str | None = None,
    ) -> int:
        if self.cluster.lost is not None:
            raise EngineLost(self.cluster.lost)
        if record is not None:
            raise ValueError("a ClusterEngine cannot resume a record: the coordinator moves "
                             "requests between its engines itself")  # fmt: skip
        self._pending += 1
        self.cluster.loop.loop.call_soon_threadsafe(
            self._submit, request_id, prompt, sampling_params, routing_key
        )
        return request_id

    def _submit(self, rid: int, prompt: Any, sp: Any, routing_key: str | None) -> None:
        try:
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            fut = self.cluster.client.add_request(prompt, sp, routing_key=routing_key)
        except Exception as e:
            self._results.put((rid, e))
            return
        self._futures[rid] = fut
        if len(self.client_request_ids) >= 1 << 16:
            self.client_request_ids.clear()
        self.client_request_ids[rid] = fut.request_id
        fut.add_done_callback(lambda f, rid=rid: self._done(rid, f))

    def _done(self, rid: int, fut: Any) -> None:
        self._futures.pop(rid, None)
        if fut.cancelled():
            self._results.put((rid, RuntimeError("request cancelled")))
        else:
            self._results.put((rid, fut.exception() or fut.result()))

    def abort(self, request_id: int) -> bool:
        """Ask the cluster to stop the request; True even if it finishes first (its record
        comes out of a later step either way)."""

        def run() -> None:
            fut = self._futures.get(request_id)
            if fut is not None and self.cluster.client is not None:
                self.cluster.client.abort(fut)

        with contextlib.suppress(RuntimeError):  # loop already stopped at shutdown
            self.cluster.loop.loop.call_soon_threadsafe(run)
        return True

    def discard(self, request_id: int) -> None:
        """Abort it and drop its record when it comes back."""
        self._discarded.add(request_id)
        self.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self._pending > 0

    def wake(self) -> None:
        """Make a blocked step() return now (the manager has a command to run)."""
        self._results.put((None, _WAKE))

    def step(self) -> StepOutput:
        if self.cluster.lost is not None:
            raise EngineLost(self.cluster.lost)
        items = []
        with contextlib.suppress(queue.Empty):
            items.append(self._results.get(timeout=self.step_timeout_s))
            while True:
                items.append(self._results.get_nowait())
        if self.cluster.lost is not None:  # what came back is the coordinator's death
            raise EngineLost(self.cluster.lost)
        finished = []
        for rid, res in items:
            if res is _WAKE:
                continue
            self._pending -= 1
            if rid in self._discarded:
                self._discarded.discard(rid)
                continue
            record = failed_record(rid, res) if isinstance(res, BaseException) else res
            for r in record.requests:
                r.request_id = rid
            finished.append(record)
        return StepOutput(finished)

    def pop_evicted_hashes(self) -> list[int]:
        return []

    def load(self) -> dict[str, Any]:
        """Requests submitted and not answered yet (each engine's own load is in `stats()`)."""
        return {"pending": self._pending}

    # ---- lifecycle ------------------------------------------------------------------------

    def suspend(self, mode: str = "recompute") -> int:
        client = self.cluster.client
        self.cluster.call(lambda: client.pause_engines())
        infos = self.cluster.call(lambda: client.suspend_engines(mode))
        return sum(int(i.get("bytes_freed", 0)) for i in infos.values())

    def release_weights(self, mode: str) -> dict:
        """Every engine frees its weights (a SUSPEND that keeps the KV as it is)."""
        client = self.cluster.client
        self.cluster.call(lambda: client.pause_engines())
        infos = self.cluster.call(lambda: client.suspend_engines("persist", weights=mode))
        freed = sum(int(i.get("weights_bytes_freed", 0)) for i in infos.values())
        return {"weights": {r: i.get("weights") for r, i in infos.items()},
                "weights_bytes_freed": freed}  # fmt: skip

    def resume(self) -> None:
        client = self.cluster.client
        self.cluster.call(lambda: client.resume_engines())
        self.cluster.call(lambda: client.unpause_engines())

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.last_sync = self.cluster.update_weights(state_dict, version)
        self.weight_version = version

    def stats(self) -> dict[str, float]:
        s = self.cluster.stats()
        out: dict[str, float] = {"engine/num_engines": len(s["engines"])}
        for rank, e in s["engines"].items():
            out[f"engine/rank{rank}/weight_version"] = e["weight_version"]
            out[f"engine/rank{rank}/assigned"] = e["assigned"]
        for k, v in s.get("counters", {}).items():
            out[f"coordinator/{k}"] = v
        sup = self.cluster.supervision_stats()
        out["engine/restarts"] = sup["restarts"]
        out["engine/stale_restarts"] = sup["stale_restarts"]
        out["engine/gave_up"] = len(sup["gave_up"])
        for k, v in self.cluster.sync_counters.items():
            out[f"weight_sync/{k}"] = v
        for rank, info in self.last_sync.items():
            for k in ("checksum", "seconds", "bytes"):
                if isinstance(info.get(k), (int, float)):
                    out[f"weight_sync/rank{rank}/{k}"] = info[k]
        return out

    def close(self) -> None:
        self.cluster.close()
