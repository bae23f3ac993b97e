"""Decode steps replayed from CUDA graphs.

A decode step of a small model launches ~500 kernels, and on an H200 launching them took ten
times as long as running them (scripts/gpu_check.py's decode_profile: 10.9 ms wall for 0.93 ms
of kernels, small preset, 32 rows). A graph replay is one launch. Graphs need fixed shapes and
fixed addresses, so a pure-decode step is padded up to a captured batch size and a captured
block-table width, and its inputs are copied into static buffers the graph reads:

- batch sizes 1, 2, 4, 8, then multiples of 16 up to `max_batch` (vLLM's buckets); widths are
  powers of two up to the longest table; each (batch, width) graph is captured the first time a
  step needs it, in one memory pool that all graphs share (only one replays at a time), and
  writes its logits into one buffer outside that pool, read before the next replay;
- padding rows repeat row 0 (same token, position, slot and table), so they write the very K/V
  row 0 writes and need no scratch slot; their logits are dropped;
- an MoE model's graphs also copy each layer's chosen experts into one buffer beside the
  logits (a [batch, moe_layers, k] copy per replay), read only by steps that record routing;
- capture runs the step once first (warm-up) on the step's own inputs, which writes the same K/V
  the replay writes again, so capturing mid-run is harmless.

Graphs hold the KV pool's address: suspend (offload, recompute) and resume re-allocate it, so the
engine drops the graphs on suspend (their pool goes back to the driver with the KV) and they are
captured again as steps need them. Weight updates copy in place and keep them valid.

With the flex attention backend the step's block mask is built on the device from the same
static buffers inside the graph, from the tables' full width (the width bucket then only bounds
the staged copy, and the compiled kernel sees one shape per batch size).

With `capture=False` the same static-shape forward runs eagerly (CPU tests check it against the
regular path; nothing else about a graph can be checked without a GPU).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import nn

from rollout.engine.config import InferenceConfig
from rollout.models.attention import StaticDecodePlan, static_flex_plan

SMALL_BATCHES = (1, 2, 4, 8)
BATCH_STEP = 16


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, 16, 32, 48, ... and `max_batch` itself."""
    sizes = [b for b in SMALL_BATCHES if b < max_batch]
    sizes += list(range(BATCH_STEP, max_batch, BATCH_STEP))
    return sorted({*sizes, max_batch})


def width_buckets(max_blocks: int) -> list[int]:
    """Captured block-table widths: powers of two, and `max_blocks` itself."""
    widths, w = [], 1
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return [*widths, max_blocks]


class DecodeGraphs:
    """Logits of pure-decode steps of up to `max_batch` rows with tables of up to `max_blocks`
    blocks, from CUDA graphs (`capture=True`) or the same static forward run eagerly."""

    def __init__(
        self, model: nn.Module, max_batch: int, max_blocks: int, device: torch.device,
        capture: bool = True, attention_backend: str = "torch",
    ) -> None:  # fmt: skip
        self.model, self.device, self.capture = model, device, capture
        self.attention_backend = attention_backend
        self.batches, self.widths = batch_buckets(max_batch), width_buckets(max_blocks)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        rows = self.batches[-1]
        # One int64 buffer: token, position, slot, context length per row, then the tables.
        self._host = torch.zeros(rows * (4 + max_blocks), dtype=torch.int64,
                                 pin_memory=device.type == "cuda")  # fmt: skip
        self._dev = torch.zeros_like(self._host, device=device)
        self._graphs: dict[tuple[int, int], tuple] = {}  # (graph, logits, experts or None)
        self._pool = None
        self._logits: torch.Tensor | None = None  # every graph's output, outside their pool
        self._routes: torch.Tensor | None = None  # MoE models: [rows, moe_layers, k] experts
        self._kv_ptr = 0
        self.counters = {"replays": 0, "captures": 0, "eager": 0}

    @classmethod
    def for_engine(
        cls, model: nn.Module, config: InferenceConfig, device: torch.device,
        attention_backend: str = "torch",
    ) -> DecodeGraphs | None:  # fmt: skip
        """An engine's graphs: None unless `config.cuda_graphs`, a CUDA device and a model with
        `forward_static_decode`."""
        if not (config.cuda_graphs and device.type == "cuda"):
            return None
        if not hasattr(model, "forward_static_decode"):
            return None
        max_blocks = -(-config.max_sequence_length // config.block_size)
        return cls(model, config.max_requests, max_blocks, device,
                   attention_backend=attention_backend)  # fmt: skip

    def accepts(self, num_rows: int, widest_table: int) -> bool:
        return 0 < num_rows <= self.max_batch and widest_table <= self.max_blocks

    def logits(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        context_lens: Sequence[int],
        tables: Sequence[Sequence[int]],
        block_size: int,
        kv_cache: torch.Tensor,
        routes: list[torch.Tensor] | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(tokens), V] of one decode token per row; writes their K/V. `routes`
        receives each MoE layer's experts [len(tokens), k] (valid until the next call).
        `token_ids` (on the device: the previous step's samples) replaces `tokens`' values."""
        n = len(tokens)
        batch = self.batches[bisect.bisect_left(self.batches, n)]
        width = self.widths[bisect.bisect_left(self.widths, max(map(len, tables)))]
        slots = [t[(c - 1) // block_size] * block_size + (c - 1) % block_size
                 for t, c in zip(tables, context_lens, strict=True)]  # fmt: skip
        self._stage(batch, width, [tokens, positions, slots, context_lens], tables)
        if token_ids is not None:  # device to device, behind the step that sampled them
            self._dev[:n].copy_(token_ids)
            self._dev[n:batch].copy_(token_ids[:1].expand(batch - n))  # padding repeats row 0:
            # its K/V lands in row 0's slot, so it must be row 0's token
        if not self.capture:
            self.counters["eager"] += 1
            layers: list[torch.Tensor] = []
            logits = self._forward(batch, width, kv_cache, layers)[:n]
            if routes is not None:
                routes.extend(r[:n] for r in layers)
            return logits
        if kv_cache.data_ptr() != self._kv_ptr:
            self.clear()
            self._kv_ptr = kv_cache.data_ptr()
        entry = self._graphs.get((batch, width))
        if entry is None:
            entry = self._graphs[(batch, width)] = self._capture(batch, width, kv_cache)
        entry[0].replay()
        self.counters["replays"] += 1
        if routes is not None and entry[2] is not None:
            routes.extend(entry[2][:n].unbind(1))
        return entry[1][:n]

    def clear(self) -> None:
        """Drop every graph and their memory pool (recaptured on demand)."""
        self._graphs.clear()
        self._pool = self._logits = self._routes = None
        self._kv_ptr = 0

    def _views(
        self, batch: int, width: int, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, StaticDecodePlan]:
        rows = self.batches[-1]
        cols = self._dev[: 4 * rows].view(4, rows)
        grid = self._dev[4 * rows :].view(rows, self.max_blocks)[:batch]
        if self.attention_backend == "flex":  # entries past `width` are stale but never read
            plan = static_flex_plan(cols[2, :batch], grid, cols[3, :batch], kv_cache.shape[2],
                                    kv_cache.shape[3])  # fmt: skip
        else:
            plan = StaticDecodePlan(cols[2, :batch], grid[:, :width], cols[3, :batch])
        return cols[0, :batch], cols[1, :batch], plan

    def _stage(self, batch: int, width: int, columns: list[Sequence[int]],
               tables: Sequence[Sequence[int]]) -> None:  # fmt: skip
        """Inputs into the static buffers, padding rows repeating row 0: one host-to-device copy."""
        rows, pad = self.batches[-1], batch - len(columns[0])
        host = self._host[: 4 * rows].view(4, rows)
        host[:, :batch] = torch.tensor([list(c) + [c[0]] * pad for c in columns])
        padded = [list(t) + [t[0]] * (width - len(t)) for t in tables]
        grid = self._host[4 * rows :].view(rows, self.max_blocks)
        grid[:batch, :width] = torch.tensor(padded + [padded[0]] * pad)
        used = 4 * rows + batch * self.max_blocks  # the tables' rows past `batch` are not read
        self._dev[:used].copy_(self._host[:used], non_blocking=True)

    def _forward(
        self, batch: int, width: int, kv_cache: torch.Tensor,
        routes: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        ids, positions, plan = self._views(batch, width, kv_cache)
        hidden = self.model.forward_static_decode(ids, positions, plan, kv_cache, routes=routes)
        return self.model.compute_logits(hidden)

    def _capture(
        self, batch: int, width: int, kv_cache: torch.Tensor
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(batch, width, kv_cache)  # warm-up: lazy inits happen outside capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._logits is None:
            vocab = self.model.lm_head.weight.shape[0]
            self._logits = torch.empty(self.batches[-1], vocab, dtype=self.model.lm_head.weight.dtype,
                                       device=self.device)  # fmt: skip
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (a weight transfer) does not break the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out, layers = self._logits[:batch], []
            out.copy_(self._forward(batch, width, kv_cache, layers))
            routes = self._routes_buffer(layers)
            if routes is not None:
                routes = routes[:batch]
                routes.copy_(torch.stack(layers, 1))
        self.counters["captures"] += 1
        return graph, out, routes

    def _routes_buffer(self, layers: list[torch.Tensor]) -> torch.Tensor | None:
        """The experts buffer of an MoE model (None for a dense one), made on first capture."""
        if layers and self._routes is None:
            shape = (self.batches[-1], len(layers), layers[0].shape[1])
            self._routes = torch.empty(shape, dtype=torch.int64, device=self.device)
        return self._routes if layers else None
