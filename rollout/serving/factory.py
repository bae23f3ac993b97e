"""Model, tokenizer and engine from a source description: the one place they are built.

A source is a preset name (random weights seeded so that every process building it gets the
same ones) or an HF checkpoint directory. The trainer (rollout.config builders), the engine
processes (`build_engine`, the default engine factory) and the cluster (`model_source_kwargs`:
any model source -> the `build_engine` kwargs that load identical weights elsewhere) all build
through here, so a trainer and its engines cannot disagree on how a source becomes a model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout.engine.config import InferenceConfig, resolve_dtype
from rollout.engine.engine import DynamicInferenceEngine
from rollout.engine.routing import experts_dtype
from rollout.models import (
    ModelConfig,
    build_model,
    from_transformers,
    load_pretrained,
    load_state_dict,
    save_pretrained,
)
from rollout.models.config import MODEL_PRESETS
from rollout.models.loader import load_config
from rollout.models.lora import load_adapter, lora_spec, save_adapter
from rollout.serving.replies import frame_bytes_for_routing
from rollout.tokenizers import ByteTokenizer, load_tokenizer
from rollout.weights.snapshot import load_snapshot
from rollout.weights.state import as_state_dict


def tokenizer_from_source(spec: str | None, source: str) -> Any:
    """`spec`: "byte", "none" (None: token-id prompts only), a tokenizer directory, or None:
    the byte tokenizer for a preset `source`, the checkpoint's own for a directory."""
    if spec == "byte" or (spec is None and source in MODEL_PRESETS):
        return ByteTokenizer()
    if spec == "none":
        return None
    return load_tokenizer(spec or source)


def model_from_source(
    source: str,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    vocab_size: int | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """(model, ModelConfig): a preset initialised from `seed` (with `vocab_size`, else the
    preset's), or a checkpoint directory loaded on `device` (cpu when None). dtype None keeps
    the model's (float32 for presets)."""
    torch_dtype = resolve_dtype(dtype)
    if source in MODEL_PRESETS:
        config = ModelConfig.preset(source, vocab_size=vocab_size)
        return build_model(config, device=device, dtype=torch_dtype, seed=seed), config
    return load_pretrained(source, device=device or "cpu", dtype=torch_dtype)


def build_engine(
    model: str = "tiny",
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    weight_version: int = 0,
    weights_file: str | None = None,
    adapter: str | None = None,
    **inference_config: Any,
) -> DynamicInferenceEngine:
    """Engine factory for worker processes: `model` is a source (`model_from_source`), a preset
    takes the tokenizer's vocabulary unless `vocab_size`; `tokenizer` a spec
    (`tokenizer_from_source`). `weights_file` (a rollout.weights.snapshot file) replaces the
    source's weights: a restarted engine starts from the last weights pushed. `adapter`: a PEFT
    LoRA folder applied unmerged (before `weights_file`, which may hold adapter tensors)."""
    tok = tokenizer_from_source(tokenizer, model)
    vocab = vocab_size or (tok.vocab_size if tok is not None else None)
    net, _ = model_from_source(model, seed=seed, device=device, dtype=dtype, vocab_size=vocab)
    if adapter is not None:
        load_adapter(net, adapter)
    if weights_file is not None:
        load_state_dict(net, load_snapshot(weights_file), strict=True)
    cfg = InferenceConfig(device=device, dtype=dtype, **inference_config)
    engine = DynamicInferenceEngine(net.eval(), tok, cfg, weight_version)
    engine.grammars.warm()  # structured outputs ready before the first request
    return engine


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
        kw = _save_weights(model, model_config, tmp())
        if tokenizer is None:  # like the embedded engine: token-id prompts only
            kw["tokenizer"] = "none"
            return kw
    else:
        raise ValueError(f"unsupported model source {type(model).__name__}")
    kw["tokenizer"] = _tokenizer_source(tokenizer, kw, tmp)
    return kw


def _save_weights(model: Any, model_config: Any, path: Path) -> dict[str, str]:
    """Save a module or state_dict source as an HF folder (and its LoRA adapter beside it, as a
    PEFT folder): the `build_engine` kwargs that load it."""
    if (
        model_config is None
        and isinstance(model, nn.Module)
        and not isinstance(getattr(model, "config", None), ModelConfig)
    ):  # a transformers model (e.g. the trainer's): the engines load a converted copy
        model, model_config = from_transformers(model)
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
    if lora_spec(model) is None:
        return {"model": str(path)}
    return {"model": str(path), "adapter": str(save_adapter(model, path / "adapter"))}


def _tokenizer_source(tokenizer: Any, kw: dict, tmp: Callable[[], Path]) -> str | None:
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


def routing_frame_bytes(factory_kwargs: Mapping[str, Any]) -> int:
    """The frame limit a routing-replay record of the longest sequence needs with the model
    `factory_kwargs` build (rollout.serving.replies.frame_bytes_for_routing); 0 for a dense
    model or one whose config cannot be read here."""
    source = factory_kwargs.get("model")
    try:
        config = (ModelConfig.preset(source) if source in MODEL_PRESETS
                  else load_config(source))  # fmt: skip
    except (TypeError, ValueError, OSError):
        return 0
    if not config.num_experts:
        return 0
    itemsize = torch.empty(0, dtype=experts_dtype(config.num_experts)).element_size()
    row = config.num_hidden_layers * config.num_experts_per_tok * itemsize  # sparse or not
    length = factory_kwargs.get("max_sequence_length", InferenceConfig.max_sequence_length)
    return frame_bytes_for_routing(row, int(length))
