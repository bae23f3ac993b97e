"""The decoder (Llama, Mistral, Qwen2/3 and their MoE variants) and its HF loader/saver."""

from __future__ import annotations

from rollout.models.attention import PagedAttentionMetadata
from rollout.models.config import ModelConfig, kv_bytes_per_block, kv_cache_shape
from rollout.models.llama import DecoderLM, build_model
from rollout.models.loader import (
    from_transformers,
    load_pretrained,
    load_state_dict,
    save_pretrained,
)

__all__ = [
    "DecoderLM",
    "ModelConfig",
    "PagedAttentionMetadata",
    "build_model",
    "from_transformers",
    "kv_bytes_per_block",
    "kv_cache_shape",
    "load_pretrained",
    "load_state_dict",
    "save_pretrained",
]
