"""`InferenceConfig`: sizes and policies of one engine, validated at construction."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

KV_POLICIES = ("recompute", "keep")
ATTENTION_BACKENDS = ("auto", "torch", "flex")
WEIGHT_UPDATES = ("pause", "staged")  # rollout.engine.staging
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _positive_int(name: str, value: Any, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"InferenceConfig.{name} must be an int, got {value!r}")
    lo = 0 if allow_zero else 1
    if value < lo:
        raise ValueError(f"InferenceConfig.{name} must be >= {lo}, got {value!r}")
    return int(value)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16; None stays None (= the model's)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(
        f"InferenceConfig.dtype must be one of {sorted(_DTYPES)} or None, got {dtype!r}"
    )


@dataclass
class InferenceConfig:
    """How big the KV pool is, how much one step may do, and what happens on eviction/updates.

    num_blocks=None sizes the pool from kv_cache_memory_bytes. max_tokens_per_step bounds the
    tokens fed through the model per step (decodes + prefill chunks); it must cover one decode
    token for every running request. kv_policy says what a weight update does to in-flight KV:
    "recompute" re-prefills under the new weights, "keep" reuses the old KV (its staleness
    counts). weight_update says how an update reaches the weights: "pause" copies the trainer's
    tensors between two steps (decoding waits for the transfer), "staged" receives and checks
    them into a second buffer while decoding goes on and flips between two steps
    (rollout.engine.staging; doubles the weights' memory). streaming_interval is the number
    of new tokens between partial outputs (0 = off).
    cuda_graphs replays decode steps from CUDA graphs on a CUDA device (rollout.engine.cuda_graphs;
    ignored elsewhere); turn it off to debug or profile the eager path. async_scheduling lets a
    decode-only step k+1 launch on step k's device-side samples before the host reads them
    (rollout.engine.overlap): the host lags the device by one step. attention_backend picks
    the paged attention: "torch" (rollout.models.attention, tuned for CPU), "flex" (PyTorch's
    FlexAttention, rollout.models.flex_attention: compiled kernels on CUDA, eager and slow on
    CPU) or "auto" (flex on CUDA when this torch has it, else torch); `resolve_attention_backend`
    decides. device/dtype None mean "the model's". batch_invariant runs the model through
    rollout.models.batch_invariant: each row's logits and log-probs are then the same bits
    whatever shares its batch, its chunking, prefix-cache hits and code path (attention always
    runs the invariant algorithm, whatever attention_backend says); start-up refuses it on a
    machine whose kernels cannot give it (BatchInvariantUnsupported naming the op).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 2**20
    max_requests: int = 64
    max_tokens_per_step: int = 2048
    max_sequence_length: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_policy: str = "recompute"
    weight_update: str = "pause"
    streaming_interval: int = 0
    cuda_graphs: bool = True
    async_scheduling: bool = False
    attention_backend: str = "auto"
    batch_invariant: bool = False
    device: str | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        self.block_size = _positive_int("block_size", self.block_size)
        if self.num_blocks is not None:
            self.num_blocks = _positive_int("num_blocks", self.num_blocks)
        self.kv_cache_memory_bytes = _positive_int(
            "kv_cache_memory_bytes", self.kv_cache_memory_bytes
        )
        self.max_requests = _positive_int("max_requests", self.max_requests)
        self.max_tokens_per_step = _positive_int("max_tokens_per_step", self.max_tokens_per_step)
        self.max_sequence_length = _positive_int("max_sequence_length", self.max_sequence_length)
        self.streaming_interval = _positive_int("streaming_interval", self.streaming_interval, True)
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "cuda_graphs",
            "async_scheduling",
            "batch_invariant",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"InferenceConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(
                f"InferenceConfig.kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"InferenceConfig.attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.weight_update not in WEIGHT_UPDATES:
            raise ValueError(f"InferenceConfig.weight_update must be one of {WEIGHT_UPDATES}, "
                             f"got {self.weight_update!r}")  # fmt: skip
        if self.max_tokens_per_step < self.max_requests:
            raise ValueError(
                f"InferenceConfig.max_tokens_per_step ({self.max_tokens_per_step}) must be >= "
                f"max_requests ({self.max_requests}): every running request decodes one token per step"
            )
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(
                    f"InferenceConfig.device is not a torch device: {self.device!r}"
                ) from e
        resolve_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return resolve_dtype(self.dtype)

    def resolve_attention_backend(self, device: torch.device) -> str:
        """ "torch" or "flex" on `device`; ValueError when flex was asked for and cannot run."""
        from rollout.models.flex_attention import flex_available

        backend = self.attention_backend
        if backend == "auto":
            return "flex" if device.type == "cuda" and flex_available() else "torch"
        if backend == "flex":
            if not flex_available():
                raise ValueError(
                    "InferenceConfig.attention_backend='flex' needs torch.nn.attention."
                    f"flex_attention, which torch {torch.__version__} lacks"
                )
            if device.type == "cuda" and self.block_size % 16:
                raise ValueError(
                    f"InferenceConfig.attention_backend='flex' on CUDA needs block_size a "
                    f"multiple of 16 (the kernels' key tile), got {self.block_size}"
                )
        return backend

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """num_blocks, or as many blocks as kv_cache_memory_bytes holds, capped at what
        max_requests full-length sequences can use (more would only hold cached prefixes)."""
        if self.num_blocks is not None:
            return self.num_blocks
        cap = self.max_requests * -(-self.max_sequence_length // self.block_size)
        n = min(self.kv_cache_memory_bytes // bytes_per_block, cap)
        if n < 1:
            raise ValueError(
                f"InferenceConfig.kv_cache_memory_bytes={self.kv_cache_memory_bytes} holds no KV block "
                f"({bytes_per_block} bytes each); raise it or set num_blocks"
            )
        return int(n)
