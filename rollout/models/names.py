"""Checkpoint names <-> the model's names for MoE experts (everything else is 1:1).

Checkpoints on disk (and transformers 4.x state dicts) name every expert's projections apart:
`...mlp.experts.{j}.{gate,up,down}_proj.weight`. The model holds them stacked as transformers
5 does in memory: `...mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first, then up) and
`...mlp.experts.down_proj` [E, H, I]. `stack_experts` maps the former to the latter (the loader,
snapshots and state dicts go through it); `split_experts` writes the disk layout back.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

import torch

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def stack_experts(tensors: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert names stacked into the model's [E, ...] tensors; other names pass through.

    ValueError naming the prefix if some expert or projection of a layer is missing."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups[m.group(1)][(m.group(3), int(m.group(2)))] = t
    for prefix, parts in groups.items():
        missing = [f"{j}.{p}" for j in range(num_experts)
                   for p in ("gate_proj", "up_proj", "down_proj") if (p, j) not in parts]  # fmt: skip
        extra = sorted({j for _, j in parts if j >= num_experts})
        if missing or extra:
            raise ValueError(
                f"{prefix}: expert tensors missing {missing[:6]} or beyond num_experts="
                f"{num_experts} {extra[:6]}"
            )
        experts = range(num_experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat((parts["gate_proj", j], parts["up_proj", j])) for j in experts]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts["down_proj", j] for j in experts])
    return out


def split_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's stacked expert tensors as per-expert checkpoint names (transformers' layout
    on disk); other names pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for j in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{j}.down_proj.weight"] = t[j].contiguous()
            else:
                gate, up = t[j].chunk(2, dim=0)
                out[f"{prefix}.{j}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{j}.up_proj.weight"] = up.contiguous()
    return out
