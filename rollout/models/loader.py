"""HF checkpoint I/O: `config.json` + `model.safetensors` (or sharded with an index).

Parameter names equal HF's, so loading is a name/shape check and a copy (MoE experts, saved one
by one, are stacked on the way in and split on the way out: rollout.models.names). Unknown
architectures, missing, unexpected or mis-shaped tensors raise `ValueError` naming them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout.models.config import ModelConfig
from rollout.models.llama import DecoderLM
from rollout.models.lora import (
    apply_lora,
    is_adapter_name,
    is_peft_model,
    is_scale_name,
    load_adapter,
    load_adapter_tensors,
    peft_parts,
    update_scope,
)
from rollout.models.names import split_experts, stack_experts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that we recompute instead of loading.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(path: str | os.PathLike) -> ModelConfig:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    return ModelConfig.from_hf(json.loads(cfg_path.read_text()))


def _checkpoint_files(path: Path) -> list[Path]:
    if (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text())
        if "weight_map" not in index:
            raise ValueError(f"{path / INDEX_FILE} has no 'weight_map'")
        files = sorted(set(index["weight_map"].values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {INDEX_FILE} are missing: {missing}")
        return [path / f for f in files]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def load_state_dict(
    model: DecoderLM, tensors: dict[str, torch.Tensor], strict: bool = True
) -> list[str]:
    """Copy HF-named tensors into `model` (casting dtype/device); returns the names loaded.

    Handles tied embeddings (`lm_head.weight` optional) and per-expert MoE names. With
    strict=True every parameter must be given and no unknown name may appear.
    """
    if model.config.num_experts:
        tensors = stack_experts(tensors, model.config.num_experts)
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update((n, b) for n, b in model.named_buffers() if is_scale_name(n))  # LoRA scales
    tied = model.config.tie_word_embeddings
    unexpected = [n for n in tensors if n not in params and not n.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        raise ValueError(f"unexpected tensors (not in the model): {sorted(unexpected)[:10]}")
    wrong = [
        f"{n}: checkpoint {tuple(t.shape)} vs model {tuple(params[n].shape)}"
        for n, t in tensors.items()
        if n in params and t.shape != params[n].shape
    ]
    if wrong:
        raise ValueError(f"mis-shaped tensors: {wrong[:10]}")
    if strict:
        optional = {"lm_head.weight"} if tied else set()
        required = update_scope(params, tensors)  # with LoRA: base, adapter or both
        missing = [n for n in required if n not in tensors and n not in optional]
        if missing:
            raise ValueError(f"missing tensors (not in the checkpoint): {sorted(missing)[:10]}")
    loaded = []
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in params or (tied and name == "lm_head.weight"):
                continue  # tied head: the embedding is the source of truth
            params[name].copy_(t)
            loaded.append(name)
    return loaded


def load_pretrained(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    adapter: str | os.PathLike | None = None,
) -> tuple[DecoderLM, ModelConfig]:
    """HF directory -> (model in eval mode, config).

    dtype=None keeps the dtype the tensors were saved in (float32 if the checkpoint holds none).
    `adapter`: a PEFT LoRA adapter folder applied unmerged (rollout.models.lora).
    """
    path = Path(path)
    config = load_config(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                tensors[name] = f.get_tensor(name)
    if dtype is None:
        floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    with torch.device("meta"):
        model = DecoderLM(config)
    model.to_empty(device=device)
    model.to(dtype=dtype)
    model.tie_weights()
    load_state_dict(model, tensors, strict=True)
    if adapter is not None:
        load_adapter(model, adapter)
    return model.eval(), config


def save_pretrained(
    model: DecoderLM,
    config: ModelConfig,
    path: str | os.PathLike,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write the HF layout: config.json + model.safetensors, or shards + index if they exceed
    max_shard_bytes. Returns the safetensors files written. The base model only: a LoRA
    adapter is saved apart (rollout.models.lora.save_adapter)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = split_experts({
        n: p.detach().to("cpu").contiguous()
        for n, p in model.named_parameters()  # duplicates removed: a tied head is saved once
        if not is_adapter_name(n)
    })  # fmt: skip
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    hf = config.to_hf()
    dtype = next(iter(state.values())).dtype
    hf["torch_dtype"] = hf["dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shards = _split(state, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata=meta)
        return [path / SINGLE_FILE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
        files.append(path / name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index: dict[str, Any] = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def _split(state: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    if max_bytes is None:
        return [state]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def from_transformers(hf_model: torch.nn.Module) -> tuple[DecoderLM, ModelConfig]:
    """A transformers causal LM of a supported architecture -> (engine model, config) holding
    copies of its weights, in its dtype and on the CPU (ValueError naming what is unsupported).

    For handing a trainer's transformers model to an engine; later `update_weights(hf_model)`
    needs no conversion (the names are the same). A PEFT-wrapped model gives its base model
    with its adapter applied unmerged (rollout.models.lora); `update_weights(peft_model)` then
    pushes the adapter alone."""
    adapter = None
    if is_peft_model(hf_model):
        hf_model, tensors, spec, adapter = peft_parts(hf_model)
    hf_config = getattr(hf_model, "config", None)
    if not hasattr(hf_config, "to_dict"):
        raise ValueError(
            f"{type(hf_model).__name__} has no transformers config (.config.to_dict())"
        )
    hf = hf_config.to_dict()
    hf["architectures"] = hf.get("architectures") or [type(hf_model).__name__]  # unsaved models
    config = ModelConfig.from_hf(hf)
    if adapter is None:
        tensors = hf_model.state_dict()
    tensors = {n: t.detach().to("cpu") for n, t in tensors.items()}
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    with torch.device("meta"):
        model = DecoderLM(config)
    model.to_empty(device="cpu")
    model.to(dtype=floats[0] if floats else torch.float32)
    model.tie_weights()
    load_state_dict(model, tensors, strict=True)
    if adapter is not None:
        apply_lora(model, spec)
        load_adapter_tensors(model, {n: t.to("cpu") for n, t in adapter.items()})
    return model.eval(), config
