"""Routing replay (R3) in the trainer: route every token to the experts the rollout chose.

Re-routing in the trainer trains a different sub-network than the one that sampled wherever
the router is near a tie (trainer and engine numerics differ, or the weights moved). With
`replay_routing(model, batch["routed_experts"], batch["routed_experts_mask"])` around the
forward, each MoE layer takes the recorded top-k experts at the masked positions and routes the
others (a prefix-cache hit's prompt, padding) itself. The routing weights of the chosen experts
are still the trainer's router probabilities (renormalised when the config says so), so the
router gets gradients through them exactly as without replay.

Works on transformers' Qwen3-MoE / Qwen2-MoE (their `...TopKRouter` modules) and on
rollout.models' DecoderLM (its `Router`). The batch's layer axis is the model's MoE layers in
order; a forward must see the whole [B, T] batch the experts were collated for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from rollout.models import batch_invariant as bi
from rollout.models.moe import Router


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order: rollout's `Router`s or transformers' top-k routers."""
    return [
        m
        for m in model.modules()
        if isinstance(m, Router)
        or (type(m).__name__.endswith("TopKRouter") and hasattr(m, "norm_topk_prob"))
    ]


@contextmanager
def replay_routing(
    model: nn.Module, routed_experts: torch.Tensor, mask: torch.Tensor | None = None
) -> Iterator[None]:
    """Within the block, `model`'s MoE layers route position (b, t) to
    `routed_experts[b, t, layer]` where `mask[b, t]` (everywhere when mask is None)."""
    routers = moe_routers(model)
    if routed_experts.dim() != 4:
        raise ValueError(
            f"routed_experts must be [B, T, moe_layers, k], got {tuple(routed_experts.shape)}"
        )
    b, t, layers, k = routed_experts.shape
    if layers != len(routers):
        raise ValueError(f"routed_experts has {layers} MoE layers, the model has {len(routers)}")
    if mask is None:
        mask = torch.ones(b, t, dtype=torch.bool)
    if mask.shape != (b, t):
        raise ValueError(f"mask must be [{b}, {t}], got {tuple(mask.shape)}")
    flat_mask = mask.reshape(-1, 1)
    for i, router in enumerate(routers):
        if router.top_k != k:
            raise ValueError(
                f"routed_experts holds top-{k} experts, the model routes top-{router.top_k}"
            )
        router.forward = _replaying(router, routed_experts[:, :, i].reshape(-1, k), flat_mask)
    try:
        yield
    finally:
        for router in routers:
            del router.forward  # back to the class's forward


def _replaying(router: nn.Module, experts: torch.Tensor, mask: torch.Tensor):
    ours = isinstance(router, Router)

    def forward(x: torch.Tensor, *_ignored: torch.Tensor | None):  # our Router's chosen, mask
        x = x.reshape(-1, router.weight.shape[1])
        if x.shape[0] != experts.shape[0]:
            raise ValueError(
                f"routing replay: the forward routes {x.shape[0]} tokens, the recorded experts "
                f"cover {experts.shape[0]} (B * T of the collated batch)"
            )
        logits = (bi.linear if bi.active() else F.linear)(x, router.weight)  # as the engine
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        m = mask.to(x.device)
        picked = torch.where(m, experts.to(device=x.device, dtype=torch.int64), own)
        top = probs.gather(-1, picked)
        if router.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        if ours:
            return top.to(x.dtype), picked
        return logits, top.to(logits.dtype), picked

    return forward
