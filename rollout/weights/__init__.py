"""Weight sync: in-process copies and a bucketed `torch.distributed` broadcast with a handshake.

- `state`: validate-then-copy into a module or state_dict in place (`copy_weights_`), and the
  checksum engines ack with (`state_dict_checksum`).
- `layout`: the flat byte stream a transfer moves (tensor offsets, chunks, manifest, checksums).
- `broadcast`: the two-phase-commit transfer, `WeightSender` (trainer) / `WeightReceiver`
  (engines): nothing is applied anywhere unless every receiver verified everything.
- `ipc`: colocated sync, `IpcSender` (trainer: packs shared buckets, hands out handles) /
  `IpcReceiver` (engines: map, verify every bucket, then apply); `benchmark_ipc_sync`.
"""

from __future__ import annotations

from rollout.weights.broadcast import (
    DEFAULT_BUCKET_BYTES,
    MAGIC,
    ApplyFn,
    SyncResult,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    init_weight_sync_group,
)
from rollout.weights.ipc import (
    IpcReceiver,
    IpcSender,
    SharedWeights,
    benchmark_ipc_sync,
    plan_buckets,
)
from rollout.weights.layout import ALIGN, TensorSlot, bucket_checksum, plan_chunks, plan_layout
from rollout.weights.state import (
    as_state_dict,
    check_compatible,
    copy_weights_,
    state_dict_checksum,
)

__all__ = [
    "ALIGN",
    "DEFAULT_BUCKET_BYTES",
    "MAGIC",
    "ApplyFn",
    "IpcReceiver",
    "IpcSender",
    "SharedWeights",
    "SyncResult",
    "TensorSlot",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "as_state_dict",
    "benchmark_ipc_sync",
    "bucket_checksum",
    "check_compatible",
    "copy_weights_",
    "init_weight_sync_group",
    "plan_buckets",
    "plan_chunks",
    "plan_layout",
    "state_dict_checksum",
]
