"""Model source -> engine factory kwargs, so every engine process loads identical weights."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from rollout.models.config import MODEL_PRESETS
from rollout.weights import as_state_dict


def model_source_kwargs(
    model: Any, seed: int, model_config: Any, tokenizer: Any, tmp: Callable[[], Path]
) -> dict[str, Any]:
    """`build_engine` kwargs so every process loads identical weights.

    A preset name builds from `seed`; a directory is an HF checkpoint; a module or state_dict is
    saved once (HF layout) to a temp dir the engines load from.
    """
    if isinstance(model, (str, os.PathLike)) and str(model) in MODEL_PRESETS:
        kw: dict[str, Any] = {"model": str(model), "seed": int(seed)}
    elif isinstance(model, (str, os.PathLike)):
        if not Path(model).is_dir():
            raise ValueError(f"model must be a preset {MODEL_PRESETS}, an HF directory or weights; "
                             f"{str(model)!r} is neither")  # fmt: skip
        kw = {"model": str(model)}
    elif isinstance(model, (nn.Module, Mapping)):
        kw = {"model": str(_save_weights(model, model_config, tmp()))}
        if tokenizer is None:  # like the embedded engine: token-id prompts only
            kw["tokenizer"] = "none"
            return kw
    else:
        raise ValueError(f"unsupported model source {type(model).__name__}")
    kw["tokenizer"] = _tokenizer_source(tokenizer, kw, tmp)
    return kw


def _save_weights(model: Any, model_config: Any, path: Path) -> Path:
    from rollout.models import build_model, load_state_dict, save_pretrained

    config = model_config if model_config is not None else getattr(model, "config", None)
    if config is None:
        raise ValueError("a state_dict model source needs model_config= (a ModelConfig)")
    if not isinstance(model, nn.Module):
        sd = as_state_dict(model)
        dtype = next(iter(sd.values())).dtype
        net = build_model(config, dtype=dtype)
        load_state_dict(net, sd)
        model = net
    save_pretrained(model, config, path)
    return path


def _tokenizer_source(tokenizer: Any, kw: dict, tmp: Callable[[], Path]) -> str | None:
    from rollout.tokenizers import ByteTokenizer

    if tokenizer is None:
        return "byte" if kw["model"] in MODEL_PRESETS else None  # None: the checkpoint's own
    if isinstance(tokenizer, (str, os.PathLike)):
        return str(tokenizer)
    if isinstance(tokenizer, ByteTokenizer):
        return "byte"
    inner = getattr(tokenizer, "_tok", None)  # HFTokenizer: write tokenizer.json beside config
    if inner is not None and hasattr(inner, "save") and kw["model"] not in MODEL_PRESETS:
        path = Path(kw["model"])
        if not (path / "tokenizer.json").exists():
            inner.save(str(path / "tokenizer.json"))
        return None
    raise ValueError(f"cannot hand tokenizer {type(tokenizer).__name__} to engine processes; "
                     "pass its directory")  # fmt: skip
