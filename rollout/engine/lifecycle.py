"""The engine between training steps: suspend and resume (the KV memory), release the weights
while asleep, close, and new weights in place (copied now, or flipped in from the staging
buffer) with the KV policy applied to every in-flight request.

Each is the body of the `DynamicInferenceEngine` method of the same name (whose docstring is
the contract); all drain the in-flight step first, so no token carries the wrong version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from rollout.engine.overlap import drain
from rollout.engine.staging import Staged, check_update
from rollout.protocol import SUSPEND_MODES
from rollout.request import Status

if TYPE_CHECKING:
    from rollout.engine.engine import DynamicInferenceEngine


def suspend(engine: DynamicInferenceEngine, mode: str) -> int:
    if mode not in SUSPEND_MODES:
        raise ValueError(f"suspend mode must be one of {SUSPEND_MODES}, got {mode!r}")
    if engine.suspended is not None:
        return 0
    drain(engine)  # its tokens carry the version that sampled them
    for seq in engine.scheduler.running:
        seq.request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
        seq.request.add_event_pause()
    engine.suspended = mode
    if mode == "persist":
        return 0
    if engine.runner.graphs is not None:  # they hold the pool's address, and memory of their own
        engine.runner.graphs.clear()
    if mode == "offload":
        return engine.kv.offload()
    for seq in engine.scheduler.running:  # recompute: each re-prefills on resume, in order
        engine.blocks.free(seq.drop_kv())
    engine.blocks.reset()
    return engine.kv.drop()


def resume(engine: DynamicInferenceEngine) -> None:
    if engine.closed:
        raise RuntimeError("engine is closed")
    if engine.suspended is None:
        return
    engine.suspended = None
    engine.kv.restore()
    engine.residency.restore()  # offloaded weights; discarded ones wait for an update
    for seq in engine.scheduler.running:
        seq.request.status = Status.ACTIVE_AND_GENERATING_TOKENS


def release_weights(engine: DynamicInferenceEngine, mode: str) -> dict:
    if engine.suspended is None:
        raise RuntimeError("release_weights() needs a suspended engine: suspend() first")
    if engine.runner.graphs is not None:  # they hold the weights' addresses
        engine.runner.graphs.clear()
    out = engine.residency.release(mode)
    if mode == "discard":  # the staging buffer holds a copy of some version too
        out["weights_bytes_freed"] += engine.weight_stage.release()
    return out


def close(engine: DynamicInferenceEngine) -> None:
    engine._inflight = None
    for rid in list(engine._seqs):
        engine.discard(rid)
    engine._done.clear()
    if engine.runner.graphs is not None:
        engine.runner.graphs.clear()
    engine.kv.close()
    engine.closed = True


def update_weights(
    engine: DynamicInferenceEngine, state_dict: Mapping[str, torch.Tensor], version: int
) -> None:
    targets = check_update(engine.model, state_dict, version, engine.weight_version,
                           "update_weights")  # fmt: skip
    engine.residency.check_covers(state_dict)
    drain(engine)  # the in-flight tokens are the old version's
    engine.residency.materialize()
    with torch.no_grad():
        for name, t in state_dict.items():
            targets[name].copy_(t)
    _after_update(engine, version)


def flip_weights(engine: DynamicInferenceEngine, staged: Staged) -> None:
    if staged is not engine.weight_stage.staged or staged.version <= engine.weight_version:
        raise ValueError(f"version {staged.version} is not the one staged for this engine "
                         f"(serving {engine.weight_version})")  # fmt: skip
    engine.residency.check_covers(staged.tensors)
    drain(engine)  # the in-flight tokens are the old version's
    engine.residency.materialize()  # a swap hands the old storage to the next stage
    engine.weight_stage.flip(staged, swap=engine.runner.graphs is None)
    _after_update(engine, staged.version)


def _after_update(engine: DynamicInferenceEngine, version: int) -> None:
    """New weights are in: stamp `version`, count the update against every in-flight
    request and apply the KV policy."""
    engine.weight_version = version
    engine.residency.loaded()
    engine.counters["weight_updates"] += 1
    recompute = engine.config.kv_policy == "recompute"
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        has_kv = bool(seq.block_table) and seq.num_computed > 0
        seq.record.increment_staleness(policy_only=not has_kv)
        if has_kv and recompute:
            engine.blocks.free(seq.drop_kv())
        elif has_kv:
            seq.cacheable = False  # its KV mixes weights: never publish it
    engine.blocks.drop_blocks_older_than(version)
