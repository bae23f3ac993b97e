"""`ModelConfig`: the Llama-family hyper-parameters under Hugging Face's field names.

One dataclass covers Llama (1/2/3) and Qwen2 checkpoints; `from_hf`/`to_hf` translate
`config.json` in both the transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters`) spellings, so checkpoints round-trip with either version.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_HF_TO_ARCH = {v: k for k, v in ARCHITECTURES.items()}
_DERIVED_FIELDS = {"architecture", "extra", "rope_theta", "rope_scaling"}  # not copied verbatim
_CONSUMED_HF_KEYS = {"architectures", "model_type", "hidden_act", "rope_theta", "rope_scaling",
                     "rope_parameters", "mlp_bias", "use_sliding_window"}  # fmt: skip
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

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
    attention_bias: bool = False  # llama: q/k/v/o biases; qwen2: q/k/v biases (always on)
    tie_word_embeddings: bool = False
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
        self.rope_scaling = _check_rope_scaling(self.rope_scaling)

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
            attn += self.q_size + 2 * self.kv_size + (h if self.architecture == "llama" else 0)
        layer = attn + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

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
        """Build from a parsed HF `config.json` (LlamaForCausalLM / Qwen2ForCausalLM)."""
        hf = dict(hf)
        arch = _architecture_of(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if hf.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")
        rope = hf.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling")
        if rope.get("rope_type", "default") not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        names = {f.name for f in dataclasses.fields(cls)} - _DERIVED_FIELDS
        kwargs = {k: hf[k] for k in names if k in hf}
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
        if self.architecture == "qwen2":
            del out["attention_bias"]  # implied by Qwen2
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


def _check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope_scaling is missing {missing}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    scaling.pop("type", None)
    scaling["rope_type"] = "llama3"
    return scaling


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
