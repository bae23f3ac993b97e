"""What a `DynamicInferenceEngine` reports: its load (for routing) and its counters (for logs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.engine.engine import DynamicInferenceEngine


def load(engine: DynamicInferenceEngine) -> dict[str, Any]:
    """Queue depth, KV usage and the tokens still to compute or generate."""
    sched = engine.scheduler
    seqs = list(sched.running) + list(sched.waiting)
    return {
        "waiting": len(sched.waiting),
        "running": len(sched.running),
        "kv_usage": engine.blocks.num_used / engine.kv.num_blocks,
        "outstanding_tokens": sum(
            s.num_uncomputed + s.request.remaining_tokens_to_generate for s in seqs
        ),
    }


def stats(engine: DynamicInferenceEngine) -> dict[str, Any]:
    """A flat dict of counters and short strings (EngineProtocol.stats)."""
    b = engine.blocks.stats
    out = dict(engine.counters)
    out.update(
        weight_version=engine.weight_version,
        tokens_computed=b.tokens_computed,
        tokens_reused=b.tokens_reused,
        prefix_cache_queries=b.cache_queries,
        prefix_cache_hits=b.cache_hits,
        prefix_cache_collisions=b.collisions,
        blocks_allocated=b.blocks_allocated,
        blocks_freed=b.blocks_freed,
        blocks_evicted=b.blocks_evicted,
        blocks_dropped=b.blocks_dropped,
        evictions=engine.scheduler.num_evictions,
        num_blocks=engine.kv.num_blocks,
        kv_cache_bytes=engine.kv.nbytes,
        suspended=engine.suspended,
        weights=engine.residency.state,  # resident | offloaded | discarded
    )
    if engine.runner.graphs is not None:
        out.update({f"decode_graph_{k}": v for k, v in engine.runner.graphs.counters.items()})
    out.update(load(engine))
    return out
