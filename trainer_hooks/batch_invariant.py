"""Batch-invariant trainer forward: the engine's behaviour log-probs, bit for bit.

Inside `enabled()` a forward (with gradients or without) runs the canonical ops of
`rollout.models.batch_invariant`, the same functions a `batch_invariant=True` engine runs, so
`trainer_hooks.losses.sequence_log_probs(logits, tokens, temperature=t)` equals the behaviour
log-probs (torch.equal) whatever the batch, padding or micro-batching:

- `ops.mode()`: our DecoderLM switches itself to the canonical ops (its `forward` is then the
  engine's op sequence, differentiable);
- a TorchFunctionMode (thread-local: the engine's thread is untouched) routes `F.linear`
  (every projection, router and lm_head) to the canonical tiled linear, and a plain causal
  `F.scaled_dot_product_attention` (a model of one's own) to the canonical attention;
- transformers' attention registry and experts registry answer with canonical functions for
  the duration (whatever `config._attn_implementation` / `_experts_implementation` say), only
  in threads inside the context; the Qwen MoE experts run `moe_experts`, the engine's exact op
  sequence.

Everything else in the supported families is already one op sequence on both sides (RMSNorm,
RoPE tables and their separate mul/add, SwiGLU, router softmax/top-k/renormalise, residuals;
README "Batch-invariant mode"). A module outside the supported families, or a forward the
canonical attention cannot reproduce (a KV cache, left padding, position ids other than
0..T-1, a sliding window shorter than the sequence, dropout, flex masks) raises
`BatchInvariantUnsupported` naming it instead of differing silently.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from rollout.models import batch_invariant as ops

# transformers attention modules whose op sequence around attention equals rollout's models
HF_ATTENTION = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
                "Qwen2MoeAttention", "Qwen3MoeAttention"}  # fmt: skip
HF_EXPERTS = {"Qwen2MoeExperts", "Qwen3MoeExperts"}

_tls = threading.local()
_lock = threading.Lock()
_patched: list[tuple[type, str, Any]] = []  # (class, attribute, original) while installed
_users = 0


# Raised, naming the op, for what cannot give the engine's bits: a model, an input, or this
# machine (the first canonical linear of a dtype and device runs ops.check_machine, memoised,
# as an engine does at start-up).
BatchInvariantUnsupported = ops.BatchInvariantUnsupported


def is_enabled() -> bool:
    """True in a thread inside `enabled()`."""
    return getattr(_tls, "depth", 0) > 0


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Run forwards in this block with the engine's batch-invariant ops (module docstring)."""
    _install_hf_patches()
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        with ops.mode(), _CanonicalOps():
            yield
    finally:
        _tls.depth -= 1
        _remove_hf_patches()


class _CanonicalOps(TorchFunctionMode):
    """F.linear -> canonical linear; F.scaled_dot_product_attention -> canonical attention."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0]
            if not _patched and "transformers" in sys.modules:
                _patch_hf()  # imported inside the block: before any attention looks itself up
            ops.check_machine(x.dtype, x.device)  # as the engine at start-up; memoised
            return ops.linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return _sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Dense causal attention from position 0 ([B, H, T, D]); GQA by the canonical op."""
    if attn_mask is not None or not is_causal:
        raise BatchInvariantUnsupported(
            "scaled_dot_product_attention: only is_causal=True without attn_mask is batch-invariant"
        )
    if dropout_p:
        raise BatchInvariantUnsupported(f"scaled_dot_product_attention: dropout_p={dropout_p}")
    if q.shape[-2] != k.shape[-2]:
        raise BatchInvariantUnsupported("scaled_dot_product_attention: queries != keys (a cache)")
    return dense_attention(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, KVH, T, D], causal from position 0 -> [B, H, T, D] (canonical)."""
    b, _, t, _ = q.shape
    positions = torch.arange(t, device=q.device).expand(b, t)
    out = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions, scale)
    return out.transpose(1, 2)


# -- transformers ---------------------------------------------------------------------------------


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: [B, H, T, D] in, [B, T, H, D] out."""
    name = type(module).__name__
    if name not in HF_ATTENTION:
        raise BatchInvariantUnsupported(
            f"{name}: no batch-invariant trainer forward for this family "
            f"(supported: {sorted(HF_ATTENTION)})"
        )
    t = query.shape[2]
    if dropout:
        raise BatchInvariantUnsupported(f"{name}: attention dropout {dropout} (call model.eval())")
    if key.shape[2] != t:
        raise BatchInvariantUnsupported(f"{name}: a KV cache (keys {key.shape[2]} != queries {t})")
    if sliding_window is not None and t > sliding_window:
        raise BatchInvariantUnsupported(f"{name}: sliding_window={sliding_window} < {t} tokens")
    if position_ids is not None and not torch.equal(
        position_ids, torch.arange(t, device=position_ids.device).expand_as(position_ids)
    ):
        raise BatchInvariantUnsupported(f"{name}: position_ids other than 0..T-1")
    _check_causal(name, attention_mask, t)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return dense_attention(query, key, value, scale).transpose(1, 2), None


def _check_causal(name: str, mask: Any, t: int) -> None:
    """Every query row that may see itself must see exactly keys 0..row (right padding only)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise BatchInvariantUnsupported(f"{name}: attention mask {type(mask).__name__} (flex)")
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed[..., -t:, -t:]
    causal = torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()
    sees_self = allowed.diagonal(dim1=-2, dim2=-1)[..., None]
    if not torch.equal(allowed & sees_self, causal & sees_self):
        raise BatchInvariantUnsupported(
            f"{name}: an attention mask other than causal with right padding (left padding?)"
        )


def _hf_experts(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """transformers' experts-interface signature, run as rollout's engine runs it."""
    name = type(module).__name__
    act = getattr(module.config, "hidden_act", "silu")
    if name not in HF_EXPERTS or act != "silu":
        raise BatchInvariantUnsupported(
            f"{name} (hidden_act={act}): no batch-invariant experts (supported: "
            f"{sorted(HF_EXPERTS)} with silu)"
        )
    return ops.moe_experts(hidden, top_k_weights, top_k_index, module.gate_up_proj,
                           module.down_proj)  # fmt: skip


def _patched_get_interface(original: Callable, replacement: Callable) -> Callable:
    def get_interface(self, implementation: str, default: Callable) -> Callable:
        if is_enabled():
            return replacement
        return original(self, implementation, default)

    return get_interface


def _install_hf_patches() -> None:
    """Registry look-ups answer with the canonical functions (in enabled threads only) while
    any thread is inside `enabled()`; nothing is patched while transformers is not imported
    (the first canonical linear patches it if it is imported inside the block)."""
    global _users
    with _lock:
        _users += 1
    if "transformers" in sys.modules:
        _patch_hf()


def _patch_hf() -> None:
    with _lock:
        if _patched or not _users:
            return
        from transformers.integrations.moe import ExpertsInterface
        from transformers.modeling_utils import AttentionInterface

        for cls, fn in ((AttentionInterface, _hf_attention), (ExpertsInterface, _hf_experts)):
            original = cls.__dict__["get_interface"]
            _patched.append((cls, "get_interface", original))
            cls.get_interface = _patched_get_interface(original, fn)


def _remove_hf_patches() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users:
            return
        while _patched:
            cls, attr, original = _patched.pop()
            setattr(cls, attr, original)
