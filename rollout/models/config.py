"""`ModelConfig`: the decoder hyper-parameters under Hugging Face's field names.

One dataclass covers Llama (1/2/3), Mistral, Qwen2, Qwen3 (per-head q/k RMSNorm) and the
sparse-MoE Qwen2-MoE / Qwen3-MoE checkpoints; `from_hf`/`to_hf` translate `config.json` in both
the transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings, so
checkpoints round-trip with either version. What the model cannot honour (another architecture,
activation, RoPE type, sliding-window layers, partial rotary) is refused by name, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.models.rope import check_rope_scaling

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_HF_TO_ARCH = {v: k for k, v in ARCHITECTURES.items()}
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")  # RMSNorm over each head of q and k before RoPE
MOE_ARCHS = ("qwen2_moe", "qwen3_moe")
_QKV_BIAS_ARCHS = ("qwen2", "qwen2_moe")  # q/k/v biases, none on o_proj
_DERIVED_FIELDS = {"architecture", "extra", "rope_theta", "rope_scaling"}  # not copied verbatim
_CONSUMED_HF_KEYS = {"architectures", "model_type", "hidden_act", "rope_theta", "rope_scaling",
                     "rope_parameters", "mlp_bias", "use_sliding_window", "qkv_bias",
                     "num_local_experts", "layer_types", "max_window_layers"}  # fmt: skip
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size")  # fmt: skip

# name -> (hidden, intermediate, layers, heads, kv_heads, default vocab)
MODEL_PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 128, 2, 4, 2, 512),
    "small": (384, 1024, 10, 6, 2, 8192),  # ~19M params with the default vocab (tied)
    "medium": (768, 2048, 12, 12, 4, 32000),  # ~100M params with the default vocab (tied)
}


@dataclass
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None -> num_attention_heads (MHA)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None or {"rope_type": "llama3", ...}
    attention_bias: bool = False  # llama/qwen3: q/k/v/o biases; qwen2(-moe): q/k/v biases
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # mistral: every layer's window (engines refuse to
    # serve sequences longer than it; see DynamicInferenceEngine)
    # sparse MoE (qwen2_moe, qwen3_moe): layer i is sparse unless i in mlp_only_layers or
    # (i + 1) % decoder_sparse_step; shared_expert_intermediate_size > 0 adds Qwen2-MoE's
    # sigmoid-gated shared expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # other HF keys

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported; use one of {sorted(ARCHITECTURES)}"
            )
        if self.architecture == "qwen2":
            self.attention_bias = True  # Qwen2 always has q/k/v biases
        if self.architecture == "mistral":
            self.attention_bias = False  # Mistral has no attention biases
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"num_attention_heads={self.num_attention_heads} does not divide "
                    f"hidden_size={self.hidden_size}"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.architecture not in MOE_ARCHS:
            if self.num_experts:
                raise ValueError(f"num_experts={self.num_experts} needs a MoE architecture "
                                 f"({list(MOE_ARCHS)}), got {self.architecture!r}")  # fmt: skip
            return
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "decoder_sparse_step"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int for {self.architecture}, "
                                 f"got {value!r}")  # fmt: skip
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} > "
                             f"num_experts={self.num_experts}")  # fmt: skip
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("shared_expert_intermediate_size must be >= 0")

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer i has a sparse MoE block (transformers' rule), else a dense MLP."""
        return (
            self.architecture in MOE_ARCHS
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def qk_norm(self) -> bool:
        return self.architecture in QK_NORM_ARCHS

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias and self.architecture not in _QKV_BIAS_ARCHS

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Exact parameter count of `build_model(self)` (tied embeddings counted once)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size + (h if self.o_proj_bias else 0)
        if self.qk_norm:
            attn += 2 * self.head_dim
        total = 0
        for layer in range(self.num_hidden_layers):
            mlp = 3 * h * i
            if self.is_sparse_layer(layer):
                e, s = self.num_experts, self.shared_expert_intermediate_size
                mlp = e * h + e * 3 * h * self.moe_intermediate_size + (3 * h * s + h if s else 0)
            total += attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return total + emb + h

    # -- presets ---------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, vocab_size: int | None = None, **overrides: Any) -> ModelConfig:
        """Llama configs for tests and recipes: "tiny" (CPU tests), "small" (~20M), "medium" (~100M)."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {name!r}; use one of {sorted(MODEL_PRESETS)}")
        h, i, n, heads, kvh, vocab = MODEL_PRESETS[name]
        kwargs: dict[str, Any] = dict(
            vocab_size=vocab_size if vocab_size is not None else vocab,
            hidden_size=h,
            intermediate_size=i,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kvh,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            rope_theta=10000.0 if name == "tiny" else 500000.0,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    # -- Hugging Face config.json ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json` (any of `ARCHITECTURES`' values)."""
        hf = dict(hf)
        arch = _architecture_of(hf)
        _refuse_unsupported_options(hf, arch)
        rope = hf.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling")
        if rope.get("rope_type", "default") not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        names = {f.name for f in dataclasses.fields(cls)} - _DERIVED_FIELDS
        kwargs = {k: hf[k] for k in names if k in hf and hf[k] is not None}
        if arch != "mistral":  # Qwen configs carry a sliding_window they only use when told
            kwargs.pop("sliding_window", None)
        if arch == "qwen2_moe":
            kwargs["attention_bias"] = hf.get("qkv_bias", True)
        if arch in MOE_ARCHS and "num_experts" not in kwargs and "num_local_experts" in hf:
            kwargs["num_experts"] = hf["num_local_experts"]  # transformers 5 writes this name
        if arch in MOE_ARCHS:
            kwargs.setdefault("shared_expert_intermediate_size", 0)
        else:
            for k in _MOE_FIELDS:
                kwargs.pop(k, None)
        extra = {k: v for k, v in hf.items() if k not in names and k not in _CONSUMED_HF_KEYS}
        return cls(
            architecture=arch, rope_theta=float(theta), rope_scaling=scaling, extra=extra, **kwargs
        )

    def to_hf(self) -> dict[str, Any]:
        """HF `config.json` dict, readable by transformers 4.x and 5.x."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "hidden_act": "silu",
        }
        for f in dataclasses.fields(self):
            if f.name not in ("architecture", "extra", "rope_scaling"):
                out[f.name] = getattr(self, f.name)
        if self.architecture not in MOE_ARCHS:
            for k in _MOE_FIELDS:
                del out[k]
        if self.architecture in ("qwen2", "mistral"):
            del out["attention_bias"]  # implied by the architecture
        if self.architecture == "qwen2_moe":
            out["qkv_bias"] = out.pop("attention_bias")
        out["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        rope_params: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_params.update(self.rope_scaling)
        out["rope_parameters"] = rope_params
        return out


def _architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    for a in archs:
        if a in _HF_TO_ARCH:
            return _HF_TO_ARCH[a]
    if archs:
        raise ValueError(f"unsupported architectures {archs}; supported: {sorted(_HF_TO_ARCH)}")
    model_type = hf.get("model_type")
    if model_type in ARCHITECTURES:
        return model_type
    raise ValueError(
        f"cannot tell the architecture: config has no supported 'architectures' and "
        f"model_type={model_type!r}; supported: {sorted(_HF_TO_ARCH)}"
    )


def _refuse_unsupported_options(hf: dict[str, Any], arch: str) -> None:
    """ValueError naming a config option the model would otherwise silently not honour."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if hf.get("use_sliding_window", False):
        raise ValueError(f"use_sliding_window=True is not supported ({arch}: per-layer windows)")
    layer_types = set(hf.get("layer_types") or []) - {"full_attention"}
    if layer_types and arch != "mistral":
        raise ValueError(
            f"layer_types {sorted(layer_types)} are not supported (full_attention only)"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of the engine's paged KV cache: [2, layers, num_blocks, block_size, kv_heads, head_dim]."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
    return (2, config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
            config.head_dim)  # fmt: skip


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return math.prod(kv_cache_shape(config, 1, block_size)) * elem
