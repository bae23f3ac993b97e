"""The coordinator's request path: submit, route, dispatch, abort, replies and failures.

`RequestPath` is the part of DataParallelInferenceCoordinator that requests go through, kept
apart from connection, control and liveness handling. The coordinator owns the state both
work on (requests, orphans, engines, clients, counters, schedule, router) and hands it over at
construction, with its three ways to send; its own handlers call `dispatch` (a request whose
engine died, or one waiting for the first engine), `fail` and `abort_on`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from rollout.protocol import MAX_ROUTING_KEY_CHARS, Headers, batch_frames, encode, pack_hashes
from rollout.sampling import MAX_CACHE_SALT_CHARS
from rollout.serving.coordinator.config import CoordinatorConfig
from rollout.serving.coordinator.peers import ClientPeer, EnginePeer, Pending
from rollout.serving.coordinator.routing import PREFIX_POLICIES, Router, affinity_key

SendEngine = Callable[[EnginePeer, bytes], bool]  # False: unreachable, the engine was removed
SendClient = Callable[[bytes, bytes], None]
SendError = Callable[[bytes, Headers | None, int | None, str], None]


MAX_TOKENS_TO_GENERATE = 2**31 - 1  # token positions are int32 on the wire


class RequestPath:
    """Request-path handlers of the coordinator, over the state it shares with them."""

    def __init__(
        self,
        config: CoordinatorConfig,
        router: Router,
        engines: dict[bytes, EnginePeer],
        clients: dict[bytes, ClientPeer],
        requests: dict[int, Pending],
        orphans: dict[int, Pending],
        counters: Counter[str],
        schedule: list[dict],
        stopping: Callable[[], bool],
        send_engine: SendEngine,
        send_client: SendClient,
        error: SendError,
    ) -> None:
        self.config = config
        self.router = router
        self.engines = engines
        self.clients = clients
        self.requests = requests
        self.orphans = orphans  # waiting for a live engine
        self.counters = counters
        self.schedule = schedule  # routing decisions, for config.schedule_output_path
        self.stopping = stopping
        self.send_engine = send_engine
        self.send_client = send_client
        self.error = error
        self.block_size = config.block_size  # None: the first engine's, when it registers
        self._next_request_id = 0

    def on_submit(
        self, client: ClientPeer, fields: list, batch: dict[bytes, list] | None = None
    ) -> None:
        crid, prompt, sp, num_tokens, stream, routing_key, salt = fields
        problem = None
        if self.stopping():
            problem = "coordinator is stopping: request refused"
        elif crid in client.requests:
            problem = f"duplicate client request id {crid}"
        elif not 1 <= num_tokens <= MAX_TOKENS_TO_GENERATE:
            problem = (f"num_tokens_to_generate must be in [1, {MAX_TOKENS_TO_GENERATE}], "
                       f"got {num_tokens}")  # fmt: skip
        elif not prompt:
            problem = "empty prompt"
        elif type(prompt) is bytes and len(prompt) % 4:
            problem = f"packed prompt length {len(prompt)} is not a multiple of 4"
        elif routing_key is not None and not 0 < len(routing_key) <= MAX_ROUTING_KEY_CHARS:
            problem = f"routing_key must have 1 to {MAX_ROUTING_KEY_CHARS} characters"
        elif salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
            problem = f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters"
        if problem is not None:
            self.counters["rejected"] += 1
            self.error(client.identity, Headers.SUBMIT_REQUEST, crid, problem)
            return
        if type(prompt) is bytes:
            prompt_len = len(prompt) // 4
            hashes = self._hashes(prompt, salt)
        else:
            prompt_len, hashes = len(prompt) // 4 + 1, []  # text: rough estimate, no hashing
        self._next_request_id += 1
        rid = self._next_request_id
        p = Pending(
            request_id=rid,
            client=client.identity,
            client_request_id=crid,
            prompt=prompt,
            sampling_params=sp,
            num_tokens=num_tokens,
            prompt_len=prompt_len,
            hashes=hashes,
            packed_hashes=pack_hashes(hashes) if hashes else b"",
            stream=stream,
            affinity=self._affinity(prompt, hashes, salt),
            routing_key=routing_key,
        )
        self.requests[rid] = p
        client.requests[crid] = rid
        self.counters["requests"] += 1
        self.dispatch(p, batch)

    def on_submit_batch(self, client: ClientPeer, fields: list) -> None:
        """Many SUBMIT_REQUESTs in one frame (the client batches what it sends per loop turn):
        each is routed on its own, then every engine gets its share in one DISPATCH_BATCH frame
        (one socket send per engine instead of one per request: the send was a third of the
        coordinator's time per request)."""
        batch: dict[bytes, list] = {}
        for row in fields[0]:
            self.on_submit(client, row, batch)
        for key, rows in batch.items():
            engine = self.engines.get(key)
            if engine is None:  # removed while routing the batch: its requests were re-routed
                continue
            # rows built here from fields validated on arrival: no second schema check
            for frame in batch_frames(Headers.DISPATCH_BATCH, rows):
                if not self.send_engine(engine, frame):
                    break  # the engine was removed and everything it held re-dispatched

    def _hashes(self, packed_prompt: bytes, salt: str | None) -> list[int]:
        """Block hashes, computed once here and forwarded so the engine need not recompute;
        chained from the request's cache_salt, as the engine chains them."""
        if self.config.policy not in PREFIX_POLICIES or self.block_size is None:
            return []
        from rollout.hashing import (  # torch: only prefix policies
            compute_block_hashes_batched,
            salted_root,
        )

        tokens = np.frombuffer(packed_prompt, dtype="<i4")
        return compute_block_hashes_batched(tokens, self.block_size, salted_root(salt))

    def _affinity(self, prompt: str | bytes, hashes: list[int], salt: str | None) -> int | None:
        """Routing-only key that keeps a group together when its prompt has no block hash
        (salted prompts group by salt too: they share no KV with other salts)."""
        if hashes or self.config.policy not in PREFIX_POLICIES:
            return None
        return affinity_key(prompt, salt)

    def dispatch(self, p: Pending, batch: dict[bytes, list] | None = None) -> None:
        """Route p to an engine (or park it until one registers, up to engine_wait_s).
        batch: collect the DISPATCH row per engine for the caller to send, instead of sending."""
        if not self.router.slots:
            if p.deadline is None:
                p.deadline = time.monotonic() + self.config.engine_wait_s
            self.orphans[p.request_id] = p
            return
        self.orphans.pop(p.request_id, None)
        p.deadline = None
        streamed = len(p.resume_tokens) // 4
        cost = p.prompt_len + streamed + max(0, p.num_tokens - streamed)
        key, match = self.router.route(p.hashes, cost, p.affinity, p.routing_key)
        engine = self.engines[key]
        p.engine, p.reserved = key, cost
        p.dispatches += 1
        engine.dispatched += 1
        engine.requests.add(p.request_id)
        if self.config.schedule_output_path and len(self.schedule) < 1_000_000:
            self.schedule.append(
                {
                    "request_id": p.request_id,
                    "client_request_id": p.client_request_id,
                    "rank": engine.rank,
                    "match": match,
                    "num_hashes": len(p.hashes),
                    "dispatch": p.dispatches,
                }
            )
        hashes = p.packed_hashes if engine.block_size == self.block_size else b""
        row = [
            p.request_id,
            p.prompt,
            p.sampling_params,
            hashes,
            bytes(p.resume_tokens),
            bytes(p.resume_log_probs),
            bytes(p.resume_versions),
            p.stream,
            bytes(p.resume_experts),
        ]
        if batch is not None:
            batch.setdefault(key, []).append(row)
            return
        frame = encode(Headers.DISPATCH_REQUEST, *row)
        self.send_engine(engine, frame)  # on failure the engine is removed and p re-dispatched

    def on_abort(self, client: ClientPeer, fields: list) -> None:
        crid = fields[0]
        rid = client.requests.get(crid)
        p = self.requests.get(rid) if rid is not None else None
        if p is None:
            self.error(client.identity, Headers.ABORT_REQUEST, crid, f"unknown request id {crid}")
            return
        self.counters["aborts"] += 1
        if p.engine is not None:
            self.send_engine(self.engines[p.engine], encode(Headers.ABORT_REQUEST, rid))
        else:  # never reached an engine: fail it here
            self.fail(p, "aborted before it reached an engine", Headers.ABORT_REQUEST)

    def abort_on(self, engine: EnginePeer, rid: int) -> None:
        """Abort rid on an engine after forgetting it here (its reservation is released by the
        caller). The engine's last published load still counts rid, and a heartbeat already in
        flight may too: drop the snapshot and ignore heartbeats until the engine's final reply
        for rid shows it has processed the abort. Routing falls back to local reservations."""
        engine.requests.discard(rid)
        engine.aborting.add(rid)
        self.router.publish_load(engine.identity, 0)
        self.send_engine(engine, encode(Headers.ABORT_REQUEST, rid))

    def on_reply(self, engine: EnginePeer, fields: list) -> None:
        out: dict[bytes, list] = {}
        aborting = engine.aborting
        for rid, record in fields[0]:
            p = self.requests.pop(rid, None)
            engine.requests.discard(rid)
            if aborting:
                aborting.discard(rid)
            if p is None:
                self.counters["late_replies"] += 1
                continue
            self.orphans.pop(rid, None)
            if p.engine is not None and p.engine != engine.identity:
                # answered by an engine we had given up on: stop the copy we re-dispatched
                other = self.engines.get(p.engine)
                if other is not None:
                    self.abort_on(other, rid)
            self.router.release(p.engine, p.reserved)
            client = self.clients.get(p.client)
            if client is not None:
                client.requests.pop(p.client_request_id, None)
                out.setdefault(p.client, []).append([p.client_request_id, record])
        self.counters["replies"] += len(fields[0])
        for identity, rows in out.items():
            self.send_client(identity, encode(Headers.REPLY, rows))

    def on_partial(self, engine: EnginePeer, fields: list) -> None:
        out: dict[bytes, list] = {}
        for rid, tokens, log_probs, versions, extra, experts in fields[0]:
            p = self.requests.get(rid)
            if p is None or p.engine != engine.identity:
                self.counters["late_partials"] += 1
                continue
            n = len(tokens) // 4
            if len(tokens) % 4 or len(log_probs) % 8 or len(versions) != 8 * n:
                self.counters["malformed"] += 1  # a checkpoint that could not resume exactly
                continue
            p.resume_tokens += tokens
            p.resume_log_probs += log_probs
            p.resume_versions += versions
            if experts is not None:
                p.resume_experts += experts
            p.reserved -= n
            self.router.release(engine.identity, n)  # never below zero (Router.release)
            if p.stream and p.client in self.clients:
                row = [p.client_request_id, tokens, log_probs, versions, extra, experts]
                out.setdefault(p.client, []).append(row)
        self.counters["partials"] += len(fields[0])
        for identity, rows in out.items():
            self.send_client(identity, encode(Headers.REPLY_PARTIAL, rows))

    def fail(self, p: Pending, message: str, ref_header: Headers = Headers.SUBMIT_REQUEST) -> None:
        """Give up on p: drop it from every map and tell its client why."""
        self.requests.pop(p.request_id, None)
        self.orphans.pop(p.request_id, None)
        if p.engine is not None:
            self.router.release(p.engine, p.reserved)
            engine = self.engines.get(p.engine)
            if engine is not None:
                engine.requests.discard(p.request_id)
        self.counters["failed"] += 1
        client = self.clients.get(p.client)
        if client is not None:
            client.requests.pop(p.client_request_id, None)
            self.error(p.client, ref_header, p.client_request_id, message)
