"""RoPE variants the supported configs name: default, linear, llama3 and yarn.

`check_rope_scaling` normalises a config's `rope_scaling` (or transformers 5's `rope_parameters`
less `rope_theta`) and refuses any other type or a missing field by name; `rope_inv_freq`
computes the fp32 inverse frequencies and the factor cos/sin are scaled by (yarn's attention
factor, 1.0 otherwise) exactly as transformers does, so positions rotate bit for bit alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}
# keys transformers may write beside a variant's parameters that do not change the rotation
_HARMLESS = {"rope_type", "type", "rope_theta"}
_KNOWN = {
    "linear": {"factor"},
    "llama3": set(_REQUIRED["llama3"]),
    "yarn": set(
        [
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ]
    ),
}


def check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """None for plain RoPE, else a copy with `rope_type` set; ValueError naming what is wrong."""
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("type", None) or scaling.get("rope_type")
    if kind in (None, "default"):
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported; supported: {list(ROPE_TYPES)}"
        )
    scaling["rope_type"] = kind
    missing = [k for k in _REQUIRED[kind] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{kind} rope_scaling is missing {missing}")
    unknown = sorted(k for k, v in scaling.items()
                     if k not in _KNOWN[kind] | _HARMLESS and v is not None)  # fmt: skip
    if unknown:
        raise ValueError(f"{kind} rope_scaling option(s) {unknown} are not supported")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    if scaling["factor"] <= 0:
        raise ValueError(f"{kind} rope_scaling needs factor > 0, got {scaling['factor']}")
    scaling.pop("rope_theta", None)
    return scaling


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(fp32 inverse frequencies [head_dim/2], the factor cos and sin are multiplied by)."""
    base = theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    )
    inv_freq = 1.0 / base
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(base, head_dim, theta, scaling, max_positions)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    pos_freqs: torch.Tensor, dim: int, theta: float, s: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`, step for step (same fp32 results)."""
    factor = s["factor"]
    old_ctx = s.get("original_max_position_embeddings") or max_positions
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
