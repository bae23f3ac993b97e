"""Weight sync, both sides: in-process copies and the transfers from a trainer to its engines.

Import from the modules:
- `state`: validate-then-copy into a module or state_dict in place (`copy_weights_`), and the
  checksum engines ack with (`state_dict_checksum`).
- `layout`: the flat byte stream a transfer moves (tensor offsets, chunks, manifest, checksums).
- `chunk_digest`: a broadcast's per-chunk digests (`keyed` BLAKE2b when authenticated on CPU).
- `broadcast`: the two-phase-commit transfer, `WeightSender` (trainer) / `WeightReceiver`
  (engines): nothing is applied anywhere unless every receiver verified everything.
- `ipc`: colocated sync, `IpcSender` (trainer: packs shared buckets, hands out handles) /
  `IpcReceiver` (engines: map, verify every bucket, then apply); `benchmark_ipc_sync`.
- `rendezvous`: the loopback-bound TCPStore both sides meet in, and the keys they use.
- `trust`: the MACs (keyed by the coordinator's secret) that make engines apply only what the
  trainer published, whatever else reaches the store or shared memory.
- `trainer_sync` / `engine_sync`: the two sides of an update to engine processes
  (`TrainerWeightSync`, `EngineWeightSync`).
- `snapshot`: the last pushed weights, which a restarted engine loads.
"""
