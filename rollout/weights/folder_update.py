"""A weight update from a folder of safetensors (vLLM's, SGLang's and AReaL's "load from disk"):
read it whole, check it against the served model exactly as an engine checks a trainer's
update, and only then hand it to the trainer path (`EngineCluster.update_weights`). A folder
that is missing a file, holds mis-shaped or unknown tensors, or another model's, raises
`ValueError` / `FileNotFoundError` naming the problem before any engine sees a byte (the
check is the engines' own, `rollout.engine.staging.check_update`), so the
served version stays as it was.

Accepted layouts: `model.safetensors.index.json` with its shards, `model.safetensors`, or any
`*.safetensors` files (vLLM's loader takes them all). HF names; per-expert MoE tensors are
stacked and a tied `lm_head.weight` may be absent, as when loading a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from rollout.models.config import MODEL_PRESETS, ModelConfig
from rollout.models.llama import DecoderLM
from rollout.models.loader import INDEX_FILE, SINGLE_FILE, load_config
from rollout.models.names import stack_experts
from rollout.weights.state import check_compatible

MAX_FILES = 4096  # shards of one folder: more is not a checkpoint


def folder_files(path: str | Path) -> list[Path]:
    """The safetensors files a folder's weights are in; FileNotFoundError naming what is missing."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a directory")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index ({e})") from None
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {INDEX_FILE} are missing: {missing[:5]}")
        return [folder / f for f in files]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
    if len(files) > MAX_FILES:
        raise ValueError(f"{len(files)} safetensors files in {str(path)!r} (at most {MAX_FILES})")
    return files


def read_folder(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors (CPU); ValueError on a duplicate or bad file."""
    tensors: dict[str, torch.Tensor] = {}
    for file in folder_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                    if name in tensors:
                        raise ValueError(f"tensor {name!r} is in more than one file")
                    tensors[name] = f.get_tensor(name)
        except (OSError, RuntimeError) as e:  # safetensors' own errors for corrupt files
            raise ValueError(f"{file.name} is not a readable safetensors file ({e})") from None
    return tensors


def shapes_of(source: str, vocab_size: int | None = None) -> nn.Module:
    """The served model's shapes without its weights (meta device): what folders are checked
    against. `source`: `rollout serve --model` (a preset, with the tokenizer's `vocab_size`,
    or an HF directory)."""
    if source in MODEL_PRESETS:
        config = ModelConfig.preset(source, vocab_size=vocab_size)
    else:
        config = load_config(source)
    with torch.device("meta"):
        model = DecoderLM(config)
    model.tie_weights()
    return model


def checked_state_dict(
    model: nn.Module, tensors: dict[str, torch.Tensor], version: int, current: int
) -> dict[str, torch.Tensor]:
    """`tensors` (HF names) as the full update `model` takes for `version`: experts stacked,
    a tied head filled in; ValueError naming every problem (the engines' own check)."""
    config = model.config
    if getattr(config, "num_experts", 0):
        tensors = stack_experts(tensors, config.num_experts)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        embed = tensors.get("model.embed_tokens.weight")
        if embed is not None:
            tensors["lm_head.weight"] = embed
    if version <= current:
        raise ValueError(f"version must be > the served {current}, got {version}")
    targets = model.state_dict(keep_vars=True)
    # a floating-point tensor casts on copy (as in the engines' check): it counts as the model's
    specs = {n: (targets[n].dtype if t.dtype.is_floating_point and n in targets else t.dtype,
                 tuple(t.shape)) for n, t in tensors.items()}  # fmt: skip
    check_compatible(targets, specs)
    return tensors
