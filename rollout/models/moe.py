"""Sparse mixture-of-experts block (Qwen2-MoE / Qwen3-MoE), in plain torch.

Parameter names and layouts equal transformers 5's in-memory ones, so a trainer's HF model
syncs without renaming: `mlp.gate.weight` [E, H] (the router), `mlp.experts.gate_up_proj`
[E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (experts stacked), and for Qwen2-MoE
`mlp.shared_expert.{gate,up,down}_proj.weight` + `mlp.shared_expert_gate.weight`. Checkpoints
on disk name experts one by one; rollout.models.names stacks and splits them.

The routed forward never loops over tokens in Python: the (token, expert) pairs are sorted by
expert, each active expert runs two matmuls over its contiguous token group
(`grouped_expert_mlp`: the function a grouped-GEMM kernel replaces on GPU), and the weighted
results are accumulated back onto their tokens (`index_put_`). The router returns its top-k
indices and takes optional `chosen` experts instead, so recording and replaying routing (R3)
add no new paths.
`forward_static` is the fixed-shape variant CUDA graphs capture (no host sync: every expert
runs on every row, unchosen ones weighted 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollout.models import batch_invariant as bi

Linear = Callable[[torch.Tensor, nn.Linear], torch.Tensor]


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense layers' MLP and Qwen2-MoE's shared expert."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """Batch-invariant mode: every GEMM through rollout.models.batch_invariant.linear."""
        gate, up = bi.module_linear(x, self.gate_proj), bi.module_linear(x, self.up_proj)
        return bi.module_linear(F.silu(gate) * up, self.down_proj)

    def forward_paged(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        """Inference only: silu and the product in place (no [N, intermediate] temporaries)."""
        h = F.silu(linear(x, self.gate_proj), inplace=True)
        return linear(h.mul_(linear(x, self.up_proj)), self.down_proj)


class Router(nn.Module):
    """Softmax over experts, top-k, optional renormalisation (transformers' TopKRouter)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(
        self, x: torch.Tensor, chosen: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [N, H] -> (weights [N, k] in x's dtype, expert indices [N, k] int64).

        `chosen` [N, k] replays given experts (their probabilities under this router are the
        weights) instead of taking the top-k; with `mask` [N] only on the rows it marks."""
        logits = bi.linear(x, self.weight) if bi.active() else F.linear(x, self.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        if chosen is None:
            top, chosen = torch.topk(probs, self.top_k, dim=-1)
        else:
            if chosen.shape != (x.shape[0], self.top_k):
                raise ValueError(f"chosen experts must be [{x.shape[0]}, {self.top_k}], "
                                 f"got {tuple(chosen.shape)}")  # fmt: skip
            chosen = chosen.to(device=x.device, dtype=torch.int64)
            if mask is not None:
                own = torch.topk(probs, self.top_k, dim=-1).indices
                chosen = torch.where(mask.to(x.device)[:, None], chosen, own)
            top = probs.gather(-1, chosen)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), chosen


class Experts(nn.Module):
    """E SwiGLU experts with their weights stacked ([E, ...]: one tensor per projection)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """x [N, H], routing weights/indices [N, k] -> sum over each token's experts [N, H]."""
        k = indices.shape[1]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        token_of = order // k
        y = grouped_expert_mlp(x.index_select(0, token_of), counts, self.gate_up_proj,
                               self.down_proj)  # fmt: skip
        y = y * weights.reshape(-1).index_select(0, order)[:, None]  # out of place: autograd
        # index_put_ accumulates serially in row order, as index_add_ does (each token's experts
        # summed in expert order, like transformers); index_add_ was measured at >100 ms per
        # call with 2 threads on a busy machine, index_put_ at 50 us
        return torch.zeros_like(x).index_put_((token_of,), y, accumulate=True)

    def forward_static(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """`forward` with shapes fixed by x alone and no host sync (CUDA-graph capturable)."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, indices, weights)  # [N, E]: 0 for experts a row did not choose
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # [E, N, H]
        return torch.einsum("enh,ne->nh", y, dense)


def grouped_expert_mlp(
    x_sorted: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Rows grouped by expert (`counts[e]` rows for expert e, in order) -> expert outputs.

    One pair of matmuls per active expert over its group; the single place a grouped-GEMM
    kernel (one launch for all groups, offsets = counts.cumsum()) would replace the loop.
    """
    out = x_sorted.new_empty(x_sorted.shape[0], down.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = x_sorted[start : start + n]
            gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
            out[start : start + n] = F.linear(F.silu(gate) * up, down[e])
            start += n
    return out


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's sigmoid-gated shared expert when the config has one)."""

    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.gate = Router(h, config.num_experts, config.num_experts_per_tok,
                           config.norm_topk_prob)  # fmt: skip
        self.experts = Experts(config.num_experts, h, config.moe_intermediate_size)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(h, shared) if shared else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.forward_routed(x.reshape(-1, shape[-1]))[0].view(shape)

    def forward_routed(
        self, x: torch.Tensor, chosen: torch.Tensor | None = None, linear: Linear | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [N, H] -> (output [N, H], the experts each row was routed to [N, k]); `chosen`
        (and `mask`): Router.forward's."""
        weights, indices = self.gate(x, chosen, mask)
        return self._combine(x, self.experts(x, weights, indices), linear), indices

    def forward_paged(
        self, x: torch.Tensor, linear: Linear, routes: list[torch.Tensor] | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`routes` (routing replay's recording) gets this layer's expert indices [N, k];
        `replay` (experts [N, k], mask [N]) routes the masked rows to recorded experts."""
        chosen, mask = replay if replay is not None else (None, None)
        out, indices = self.forward_routed(x, chosen, linear, mask)
        if routes is not None:
            routes.append(indices)
        return out

    def forward_invariant(
        self, x: torch.Tensor, routes: list[torch.Tensor] | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Batch-invariant mode (inside batch_invariant.mode(), which the router reads):
        transformers' expert loop with invariant GEMMs; `routes`/`replay` as forward_paged's."""
        chosen, mask = replay if replay is not None else (None, None)
        weights, indices = self.gate(x, chosen, mask)
        if routes is not None:
            routes.append(indices)
        e = self.experts
        out = bi.moe_experts(x, weights, indices, e.gate_up_proj, e.down_proj)
        if self.shared_expert is None:
            return out
        gate = torch.sigmoid(bi.linear(x, self.shared_expert_gate.weight))
        return out + gate * self.shared_expert.forward_invariant(x)

    def forward_static(
        self, x: torch.Tensor, linear: Linear, routes: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        weights, indices = self.gate(x)
        if routes is not None:
            routes.append(indices)
        return self._combine(x, self.experts.forward_static(x, weights, indices), linear)

    def _combine(
        self, x: torch.Tensor, routed: torch.Tensor, linear: Linear | None
    ) -> torch.Tensor:
        if self.shared_expert is None:
            return routed
        if linear is None:
            shared = self.shared_expert(x)
        else:
            shared = self.shared_expert.forward_paged(x, linear)
        return routed + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
