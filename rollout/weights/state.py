"""In-process weight updates: validate every name, shape and dtype first, then copy in place.

`check_compatible` guards `RolloutManager.update_weights` and the broadcast receiver's manifest;
`copy_weights_` is the receiver's in-place apply; `state_dict_checksum` is what engines ack with.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
from torch import nn

from rollout.models.lora import peft_adapter, update_scope
from rollout.weights.layout import _byte_view


def as_state_dict(source: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A name -> tensor mapping from a module (its state_dict, detached) or a mapping; a
    PEFT-wrapped module gives its adapter alone (an adapter-only update: rollout.models.lora)."""
    adapter = peft_adapter(source)
    if adapter is not None:
        return adapter
    if isinstance(source, nn.Module):
        return {k: v.detach() for k, v in source.state_dict().items()}
    if isinstance(source, Mapping):
        for k, v in source.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                raise TypeError(f"state_dict entries must be str -> Tensor, got {k!r}: {type(v)}")
        return dict(source)
    raise TypeError(f"expected an nn.Module or a state_dict mapping, got {type(source).__name__}")


def _target_tensors(target: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(target, nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return dict(target)


def check_compatible(
    target: Mapping[str, torch.Tensor],
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    *,
    strict: bool = True,
    allow_cast: bool = False,
) -> None:
    """Raise ValueError listing every name/shape/dtype problem (all of them, not the first)."""
    problems: list[str] = []
    unexpected = sorted(set(specs) - set(target))
    if unexpected:
        problems.append(
            f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    if strict:
        missing = sorted(update_scope(target, specs) - set(specs))  # a LoRA model: see there
        if missing:
            problems.append(f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}")
    for name, (dtype, shape) in specs.items():
        t = target.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(shape)} != model {tuple(t.shape)}")
        if t.dtype != dtype and not allow_cast:
            problems.append(f"{name}: dtype {dtype} != model {t.dtype}")
    if problems:
        raise ValueError("incompatible weights: " + "; ".join(problems))


@torch.no_grad()
def copy_weights_(
    target: nn.Module | Mapping[str, torch.Tensor],
    source: nn.Module | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    allow_cast: bool = False,
) -> int:
    """Copy `source` into `target` in place; validate everything first. Returns bytes copied.

    In place (not `load_state_dict(assign=True)`) so references the engine holds to parameter
    storage stay valid, and tied weights stay tied. `strict=False` allows a partial update
    (missing names keep their values); unexpected names are always an error.
    """
    dst = _target_tensors(target)
    src = as_state_dict(source)
    check_compatible(
        dst,
        {k: (v.dtype, tuple(v.shape)) for k, v in src.items()},
        strict=strict,
        allow_cast=allow_cast,
    )
    nbytes = 0
    for name, value in src.items():
        d = dst[name]
        d.copy_(value, non_blocking=False)
        nbytes += d.numel() * d.element_size()
    return nbytes


def state_dict_checksum(source: nn.Module | Mapping[str, torch.Tensor]) -> int:
    """crc32 over the raw bytes of every tensor in name order (CPU copy): a cheap identity test."""
    crc = 0
    for name, t in sorted(as_state_dict(source).items()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(_byte_view(t.detach().cpu()).numpy(), crc)
    return crc
