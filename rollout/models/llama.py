"""Llama-family decoder (Llama 1/2/3, Mistral, Qwen2, Qwen3, Qwen2/3-MoE) in plain torch,
gpt-fast style.

Module and parameter names equal Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...),
so trainer state dicts and HF checkpoints load the same way. Two entry points:
`forward(tokens)` (dense causal, no cache: training and reference decoding) and
`forward_paged(...)` (flattened ragged batch over the engine's paged KV cache).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollout.models import batch_invariant as bi
from rollout.models.attention import (
    AttentionPlan,
    PagedAttentionMetadata,
    StaticDecodePlan,
    paged_attention,
)
from rollout.models.config import ModelConfig
from rollout.models.invariant_paged import (
    InvariantPlan,
    invariant_paged_attention,
    plan_paged,
    plan_static,
)
from rollout.models.moe import MLP, SparseMoeBlock
from rollout.models.packed import PackedLinears
from rollout.models.rope import rope_inv_freq

Linear = Callable[[torch.Tensor, nn.Linear], torch.Tensor]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # F.rms_norm's fp32 steps, bitwise, with fewer temporaries than its CPU composite
            # (measured 4% of a decode step and 6% of a prefill step, small preset)
            y = x * (x * x).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            return y * self.weight if torch.is_grad_enabled() else y.mul_(self.weight)
        # Normalise in fp32 and scale in the input dtype, as HF does (bit-compatible in bf16).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary:
    """cos/sin for arbitrary positions; inv_freq stays fp32 whatever dtype the model is cast to."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq, self.scale = rope_inv_freq(config.head_dim, config.rope_theta,
                                                  config.rope_scaling,
                                                  config.max_position_embeddings)  # fmt: skip
        self._per_device: dict[torch.device, torch.Tensor] = {}

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._per_device.get(positions.device)
        if inv is None:
            inv = self._per_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * inv  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:  # yarn's attention factor, applied as transformers does
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)

    def paged(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [N, 1, D] for `rope_`: computed once per forward."""
        cos, sin = self(positions, dtype)
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return cos[:, None], sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D]; cos/sin [..., T, D] (half-rotation layout, as HF)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in place on a fresh x [N, heads, D] with `Rotary.paged` tables: the same
    products and sums (x * cos + [x2, x1] * [-sin, sin]), three kernels instead of six."""
    half = x.shape[-1] // 2
    rot = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(signed_sin)
    return x.mul_(cos).add_(rot)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, config.q_size, bias=bias)
        self.k_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, config.kv_size, bias=bias)
        # Llama's/Qwen3's attention_bias covers o_proj too; Qwen2's q/k/v biases do not.
        self.o_proj = nn.Linear(config.q_size, h, bias=config.o_proj_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head of q and k, before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.transpose(1, 2) for y in self._qkv(x, cos, sin))  # [B, heads, T, D]
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_paged(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan | StaticDecodePlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        linear: Linear,
    ) -> torch.Tensor:
        """Inference only (tensors are updated in place): x [N, hidden], rope from Rotary.paged."""
        n = x.shape[0]
        q = linear(x, self.q_proj).view(n, self.num_heads, self.head_dim)
        k = linear(x, self.k_proj).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_(q, *rope), rope_(k, *rope)
        v = linear(x, self.v_proj).view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, plan, self.scale)
        return linear(out.reshape(n, -1), self.o_proj)

    def forward_invariant(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Batch-invariant mode (rollout.models.batch_invariant), out of place (autograd):
        x [N, hidden], cos/sin [N, 1, D]; `attend` maps q [N, H, D], k/v [N, KVH, D] to
        [N, H, D]."""
        n = x.shape[0]
        q = bi.module_linear(x, self.q_proj).view(n, self.num_heads, self.head_dim)
        k = bi.module_linear(x, self.k_proj).view(n, self.num_kv_heads, self.head_dim)
        v = bi.module_linear(x, self.v_proj).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = bi.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = bi.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = bi.apply_rope(q, cos, sin), bi.apply_rope(k, cos, sin)
        return bi.module_linear(attend(q, k, v).reshape(n, -1), self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.is_sparse = config.is_sparse_layer(index)
        if self.is_sparse:
            self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderLM(nn.Module):
    """`batch_invariant = True` (or rollout.models.batch_invariant.mode()) runs every entry
    point through the batch-invariant ops: a row's bits then do not depend on the batch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.batch_invariant = False
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)
        self.packed = PackedLinears()  # decode-sized CPU matmuls (forward_paged only)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V]; plain causal attention from position 0, no cache."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if self.invariant:
            return self._invariant_forward(tokens)
        x = self.model.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def forward_paged(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: PagedAttentionMetadata,
        kv_cache: torch.Tensor,
        routes: list[torch.Tensor] | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Flattened ragged batch -> final-normed hidden states [N, H] (feed to `compute_logits`).

        input_ids/positions [N]; kv_cache [2, layers, blocks, block_size, kv_heads, head_dim].
        The new tokens' K/V are written into kv_cache at meta.slot_mapping. `routes`, when given,
        receives each MoE layer's expert indices [N, k] in layer order (routing replay);
        `replay` (experts [N, moe_layers, k], mask [N]) routes the masked rows to those experts.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be 1-D of equal length, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        c = self.config
        expected = (2, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        got = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[4:])
        if kv_cache.dim() != 6 or got != expected:
            raise ValueError(
                f"kv_cache must be [2, {c.num_hidden_layers}, blocks, block_size, "
                f"{c.num_key_value_heads}, {c.head_dim}], got {tuple(kv_cache.shape)}"
            )
        if input_ids.shape[0] != meta.slot_mapping.shape[0]:
            raise ValueError(
                f"slot_mapping has {meta.slot_mapping.shape[0]} entries for {input_ids.shape[0]} tokens"
            )
        if self.invariant:
            plan = plan_paged(meta, kv_cache.shape[3], input_ids.shape[0])
            return self._invariant_paged(input_ids, positions, plan, kv_cache, routes, replay)
        plan = AttentionPlan(meta, kv_cache.shape[3], input_ids.shape[0], kv_cache.shape[2])
        self.packed.observe(input_ids.shape[0], self.lm_head.weight)
        return self._paged_layers(input_ids, positions, plan, kv_cache, routes=routes,
                                  replay=replay)  # fmt: skip

    @torch.no_grad()
    def forward_static_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: StaticDecodePlan,
        kv_cache: torch.Tensor,
        routes: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`forward_paged` for one decode token per row, every shape fixed by the inputs' sizes
        and no host work: what a CUDA graph captures (rollout.engine.cuda_graphs)."""
        if self.invariant:
            inv = plan_static(plan, positions, kv_cache.shape[3])
            return self._invariant_paged(input_ids, positions, inv, kv_cache, routes)
        return self._paged_layers(input_ids, positions, plan, kv_cache, True, routes)

    def _paged_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan | StaticDecodePlan,
        kv_cache: torch.Tensor,
        static: bool = False,
        routes: list[torch.Tensor] | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        linear = self.packed
        sparse = 0  # MoE layers so far: the replay's layer axis
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.paged(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x += layer.self_attn.forward_paged(
                layer.input_layernorm(x), rope, plan, kv_cache[0, i], kv_cache[1, i], linear
            )
            h = layer.post_attention_layernorm(x)
            if not layer.is_sparse:
                x += layer.mlp.forward_paged(h, linear)
            elif static:  # no host sync inside a CUDA graph
                x += layer.mlp.forward_static(h, linear, routes)
            else:
                rows = None if replay is None else (replay[0][:, sparse], replay[1])
                x += layer.mlp.forward_paged(h, linear, routes, rows)
                sparse += 1
        return self.model.norm(x)

    @property
    def invariant(self) -> bool:
        return self.batch_invariant or bi.active()

    def _invariant_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """`forward` in batch-invariant mode (differentiable): the engine's op sequence."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        scale = self.model.layers[0].self_attn.scale if self.model.layers else 1.0
        c = self.config

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q4 = q.view(b, t, c.num_attention_heads, c.head_dim)
            k4 = k.view(b, t, c.num_key_value_heads, c.head_dim)
            out = bi.attention(q4, k4, v.view_as(k4), positions, scale)
            return out.reshape(b * t, c.num_attention_heads, c.head_dim)

        x = self.model.embed_tokens(tokens).reshape(b * t, -1)
        hidden = self._invariant_layers(x, positions.reshape(-1), attend)
        return bi.linear(hidden, self.lm_head.weight).view(b, t, -1)

    def _invariant_paged(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: InvariantPlan,
        kv_cache: torch.Tensor,
        routes: list[torch.Tensor] | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            scale = self.model.layers[i].self_attn.scale
            return invariant_paged_attention(q, k, v, kv_cache[0, i], kv_cache[1, i], plan, scale)

        x = self.model.embed_tokens(input_ids)
        return self._invariant_layers(x, positions, attend, routes, replay)

    def _invariant_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        routes: list[torch.Tensor] | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [N, hidden] at positions [N] -> final-normed hidden states [N, hidden], every op
        from rollout.models.batch_invariant and out of place (the trainer differentiates it)."""
        with bi.mode():  # MoE routers (and routing replay's overrides) read it
            cos, sin = bi.rope_cos_sin(positions, self.rotary.inv_freq, self.rotary.scale,
                                       x.dtype)  # fmt: skip
            cos, sin = cos[:, None], sin[:, None]
            sparse = 0
            for i, layer in enumerate(self.model.layers):
                norm = layer.input_layernorm
                h = bi.rms_norm(x, norm.weight, norm.eps)
                x = x + layer.self_attn.forward_invariant(
                    h, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v)
                )
                norm = layer.post_attention_layernorm
                h = bi.rms_norm(x, norm.weight, norm.eps)
                if not layer.is_sparse:
                    x = x + layer.mlp.forward_invariant(h)
                    continue
                rows = None if replay is None else (replay[0][:, sparse], replay[1])
                x = x + layer.mlp.forward_invariant(h, routes, rows)
                sparse += 1
            norm = self.model.norm
            return bi.rms_norm(x, norm.weight, norm.eps)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states from `forward_paged` (already final-normed) -> logits [..., V]."""
        if self.invariant:
            return bi.linear(hidden, self.lm_head.weight)
        if hidden.dim() == 2:
            return self.packed(hidden, self.lm_head)
        return self.lm_head(hidden)


def build_model(
    config: ModelConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> DecoderLM:
    """Randomly initialised `DecoderLM` (std 0.02 like HF Llama, norms at 1, biases at 0;
    MoE routers and experts at std 0.02 too)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    model = DecoderLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.to(device=device, dtype=dtype)
