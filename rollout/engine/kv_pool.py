"""The paged KV pool: one tensor holding every layer's K and V blocks, and where its memory is
between training steps.

RL frees the pool while the trainer runs: `offload` copies it to host memory (pinned on CUDA,
for a fast copy back) and `restore` brings it back bit for bit; `drop` discards it, and
`restore` then gives a zeroed pool whose blocks the engine recomputes. Either way the device
memory goes back to the driver, not only to torch's caching allocator, so the trainer can use it.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.engine.config import InferenceConfig
from rollout.models.config import kv_bytes_per_block, kv_cache_shape


class KVPool:
    """`cache` is the pool tensor while it is on the device, None while offloaded or dropped."""

    def __init__(
        self, model_config: Any, config: InferenceConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        block_bytes = kv_bytes_per_block(model_config, config.block_size, dtype)
        self.num_blocks = config.resolve_num_blocks(block_bytes)
        self.shape = kv_cache_shape(model_config, self.num_blocks, config.block_size)
        self.device, self.dtype = device, dtype
        self.cache: torch.Tensor | None = torch.zeros(self.shape, dtype=dtype, device=device)
        self.nbytes = self.cache.numel() * self.cache.element_size()
        self.backup: torch.Tensor | None = None  # the host copy while offloaded

    def offload(self) -> int:
        """Copy the pool to host memory and free it on the device; returns the bytes freed."""
        pin = self.device.type == "cuda"
        self.backup = torch.empty(self.shape, dtype=self.dtype, device="cpu", pin_memory=pin)
        self.backup.copy_(self.cache)
        return self._free_device()

    def drop(self) -> int:
        """Free the pool on the device, contents lost; returns the bytes freed."""
        return self._free_device()

    def restore(self) -> None:
        """Put the pool back on the device: the offloaded copy, else zeros."""
        if self.cache is not None:
            return
        if self.backup is None:
            self.cache = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            return
        self.cache = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.cache.copy_(self.backup)
        self.backup = None

    def close(self) -> None:
        """Free the pool and any host copy for good."""
        self.backup = None
        if self.cache is not None:
            self._free_device()

    def _free_device(self) -> int:
        self.cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the pool back to the driver, not just the allocator
        return self.nbytes
