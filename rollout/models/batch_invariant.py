"""Batch-invariant ops: a row's result is the same bits whatever else shares its batch.

The engine (in `InferenceConfig(batch_invariant=True)`) and the trainer
(`trainer_hooks.batch_invariant.enabled()`) both call THESE functions, so behaviour and trainer
log-probs are computed by one op sequence. Why fixed shapes: a CPU (or GPU) GEMM picks its
kernel, blocking and reduction order from the matrix sizes, so `F.linear(x[:3])` and
`F.linear(x)[:3]` can differ in the last bit. Every op here keeps the shape each output element
is reduced under fixed:

- `linear`: rows zero-padded to a multiple of ROW_TILE and multiplied tile by tile (one bmm of
  [ROW_TILE, K] x [K, N] tiles); the bias is a separate add.
- `attention`: one algorithm for prefill, decode, paged and dense. Query rows in tiles of
  ROW_TILE, keys in position-aligned blocks of KV_SPLIT; scores by fixed-shape tile GEMMs (times
  the scale as a separate multiply), the exact per-query max, p = exp(s - max), and per key block
  p_j @ V_j and rowsum(p_j) (fixed [ROW_TILE, KV_SPLIT] x [KV_SPLIT, D] tiles) summed over the
  blocks in ascending order in fp64 (rounded once to fp32). Blocks past a query's position add
  exact zeros, so a query gets the same bits in a 1-token decode, a long prefill chunk or a
  dense training forward.
- `rms_norm`, `apply_rope`, `rope_cos_sin`: transformers' op sequences (elementwise ops and
  last-dim reductions, row-invariant as they are).
- `log_softmax` / `token_log_probs`: fp32, the temperature one fp32 divide (none at 1.0).
- `moe_experts` / `router`: transformers' Qwen3-MoE sequence with `linear` for every matmul;
  each token's expert outputs are added in ascending expert order.

`check_machine` tests all of this on the machine at hand (a needle row alone vs inside batches,
1 vs N threads) and raises `BatchInvariantUnsupported` naming the op that is not invariant.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

ROW_TILE = 16  # rows per GEMM tile (linear and attention queries)
K_TILE = 16  # GEMM reduction dims are zero-padded to a multiple of this
KV_SPLIT = 16  # keys per attention block (position-aligned: block j = [16j, 16j + 16))
_ATTN_CHUNK = 1 << 24  # elements per attention work chunk (bounds memory, not the result)

_state = threading.local()


class BatchInvariantUnsupported(RuntimeError):
    """The machine cannot give batch-invariant results for the op the message names."""


@contextlib.contextmanager
def mode() -> Iterator[None]:
    """Within this context `active()` is True: models that check it use these ops."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def active() -> bool:
    return getattr(_state, "depth", 0) > 0


# ---------------------------------------------------------------------------------------- GEMM


def _pad_rows(x: torch.Tensor, tile: int) -> torch.Tensor:
    pad = -x.shape[0] % tile
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's bits independent of the other rows: rows are
    zero-padded to ROW_TILE and multiplied tile by tile (fixed [ROW_TILE, K] x [K, N] GEMMs).
    K is zero-padded to a multiple of K_TILE and N to at least 2: odd K (5, 33) and N = 1 (a
    gemv-like path) were measured to depend on the tile count (no copy when K % 16 == 0)."""
    shape = x.shape
    out_features = weight.shape[0]
    rows = x.reshape(-1, shape[-1])
    m = rows.shape[0]
    k_pad, n_pad = -shape[-1] % K_TILE, max(0, 2 - out_features)
    if k_pad:
        rows, weight = F.pad(rows, (0, k_pad)), F.pad(weight, (0, k_pad))
    if n_pad:
        weight = F.pad(weight, (0, 0, 0, n_pad))
    tiles = _pad_rows(rows, ROW_TILE).view(-1, ROW_TILE, rows.shape[-1])
    wt = weight.t()
    out = torch.bmm(tiles, wt.expand(tiles.shape[0], *wt.shape)).reshape(-1, weight.shape[0])
    out = out[:m, :out_features]
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], out_features)


def module_linear(x: torch.Tensor, lin: torch.nn.Module) -> torch.Tensor:
    """`linear` for an nn.Linear, plus its LoRA term (rollout.models.lora: scale * B(A(x)),
    PEFT's order) through `linear` too."""
    out = linear(x, lin.weight, lin.bias)
    if getattr(lin, "lora_A", None) is None:
        return out
    return out + linear(linear(x, lin.lora_A.weight), lin.lora_B.weight) * lin.lora_scale


# ----------------------------------------------------------------------------- norms and RoPE


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op: normalise in fp32, scale in the input dtype."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., D] for integer positions: position * inv_freq in fp32 (transformers' K=1
    matmul gives the same products), duplicated halves, times the attention factor."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin: separate multiplies and add (no fused multiply-add), as
    transformers writes it; cos/sin must broadcast against x."""
    return (x * cos) + (rotate_half(x) * sin)


# -------------------------------------------------------------------------------- attention


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    k_lens: torch.Tensor | None = None,
    k_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention with one reduction order for every batch shape.

    q [B, n, H, D] at absolute positions q_positions [B, n]; k, v [B, L, KVH, D] hold positions
    0..L-1 of each sequence. A query at position p attends keys 0..p that are below k_lens[b]
    (default L) and, when given, marked by k_mask [B, L]. Returns [B, n, H, D] in q's dtype.
    A query with no key to attend gives NaN (callers pad with position >= 0).
    """
    n, heads = q.shape[1], q.shape[2]
    length, kvh = k.shape[1], k.shape[2]
    if heads % kvh:
        raise ValueError(f"{heads} query heads are not a multiple of {kvh} key/value heads")
    dtype = q.dtype
    n_pad, l_pad = -n % ROW_TILE, -length % KV_SPLIT
    key_pos = torch.arange(length + l_pad, device=q.device)
    valid = key_pos[None, :] < (length if k_lens is None else k_lens[:, None])  # [B, L']
    if k_mask is not None:
        valid = valid & F.pad(k_mask.to(torch.bool), (0, l_pad))
    d_pad = -q.shape[-1] % K_TILE  # the scores' reduction dim, as in `linear`
    qf = F.pad(q.float(), (0, d_pad, 0, 0, 0, n_pad)).transpose(1, 2)  # [B, H, n', D']
    group = heads // kvh
    kf = F.pad(k.float(), (0, d_pad, 0, 0, 0, l_pad)).transpose(1, 2)
    vf = F.pad(v.float(), (0, 0, 0, 0, 0, l_pad)).transpose(1, 2)
    if group > 1:  # GQA by index (exact copies)
        kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    vf = vf.masked_fill(~valid[:, None, :, None], 0.0)  # no garbage (NaN) times a zero weight
    qpos = F.pad(q_positions.to(key_pos.dtype), (0, n_pad))  # padding queries see key 0
    allowed = (key_pos[None, None, :] <= qpos[:, :, None]) & valid[:, None, :]  # [B, n', L']
    out = _attend(qf, kf, vf, allowed, scale)  # [B, H, n', D] fp32
    return out[:, :, :n].transpose(1, 2).to(dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q/k [B, H, n/L, D], v [B, H, L, Dv] (n, L multiples of the tiles), allowed [B, n, L]
    -> [B, H, n, Dv]."""
    b, h, n, d = q.shape
    length, dv = k.shape[2], v.shape[-1]
    nqt, nkb = n // ROW_TILE, length // KV_SPLIT
    q = q.reshape(b * h, nqt, ROW_TILE, d)
    k = k.reshape(b * h, length, d)
    v = v.reshape(b * h, nkb, KV_SPLIT, dv)
    allowed = allowed[:, None].expand(b, h, n, length).reshape(b * h, nqt, ROW_TILE, length)
    per_bh = nqt * length * max(d, ROW_TILE)
    step = max(1, _ATTN_CHUNK // max(per_bh, 1))
    outs = [_attend_chunk(q[i : i + step], k[i : i + step], v[i : i + step],
                          allowed[i : i + step], scale)
            for i in range(0, b * h, step)]  # fmt: skip
    return torch.cat(outs).view(b, h, n, dv)


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [G, nqt, T, D], k [G, L, D], v [G, nkb, S, Dv], allowed [G, nqt, T, L] -> [G, n, Dv]."""
    g, nqt, t, d = q.shape
    length, dv = k.shape[1], v.shape[-1]
    nkb = length // KV_SPLIT
    kt = k.transpose(1, 2)[:, None].expand(g, nqt, d, length).reshape(g * nqt, d, length)
    s = torch.bmm(q.reshape(g * nqt, t, d), kt).view(g, nqt, t, length)  # [T, D] x [D, L] tiles
    s = (s * scale).masked_fill(~allowed, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))  # the exact max over the query's keys
    p = p.view(g, nqt, t, nkb, KV_SPLIT)
    den = p.sum(-1)  # [G, nqt, T, nkb]: per block, a KV_SPLIT-long last-dim sum
    pt = p.permute(0, 1, 3, 2, 4).reshape(g * nqt * nkb, t, KV_SPLIT)
    vt = v[:, None].expand(g, nqt, nkb, KV_SPLIT, dv).reshape(g * nqt * nkb, KV_SPLIT, dv)
    num = torch.bmm(pt, vt).view(g, nqt, nkb, t, dv)  # [T, S] x [S, Dv] tiles
    num = _ordered_sum(num, 2)  # [G, nqt, T, D]
    den = _ordered_sum(den, 3)  # [G, nqt, T]
    return (num / den[..., None]).reshape(g, nqt * t, dv)


def _ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` in ascending index order, accumulated in fp64, rounded once to fp32: the
    CPU cumsum kernel is a sequential scan; elsewhere an explicit loop keeps the order."""
    if x.device.type == "cpu":
        return x.double().cumsum(dim).select(dim, -1).float()
    acc = torch.zeros_like(x.select(dim, 0), dtype=torch.float64)
    for part in x.unbind(dim):
        acc = acc + part.double()
    return acc.float()


# ----------------------------------------------------------------------------------- log-probs


def log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """log_softmax(logits / t) over the last dim in fp32; `temperature` a number or one fp32
    value per row (a [B] tensor for logits [B, V]). The divide is skipped for the number 1.0
    (x / 1.0 == x exactly, so a tensor of ones gives the same bits)."""
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=x.device, dtype=torch.float32)
        if t.dim() == 1:
            t = t.view(-1, *([1] * (x.dim() - 1)))
        return torch.log_softmax(x / t, dim=-1)
    if temperature == 1.0:
        return torch.log_softmax(x, dim=-1)
    return torch.log_softmax(x / torch.tensor(temperature, dtype=torch.float32), dim=-1)


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """logits [..., V], tokens [...] -> the log-prob of each token, fp32 (`log_softmax`'s)."""
    logp = log_softmax(logits, temperature)
    return logp.gather(-1, tokens[..., None].to(logp.device)).squeeze(-1)


# ----------------------------------------------------------------------------------------- MoE


def router(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    chosen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (routing weights [N, k] in x's dtype, experts [N, k]): transformers'
    Qwen3MoeTopKRouter with `linear` for the router GEMM; `chosen` replays given experts."""
    probs = F.softmax(linear(x, weight), dim=-1, dtype=torch.float)
    if chosen is None:
        top, chosen = torch.topk(probs, top_k, dim=-1)
    else:
        top = probs.gather(-1, chosen)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(x.dtype), chosen


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """x [N, H], routing weights/indices [N, k], stacked experts gate_up [E, 2I, H] and down
    [E, H, I] -> [N, H]: transformers' Qwen3MoeExperts (per expert: gate/up, act(gate) * up,
    down, times the weight) with `linear`; each token's outputs added in ascending expert order
    (one add per token per expert, so the order is the expert loop's)."""
    out = torch.zeros_like(x)
    for e in torch.unique(indices).tolist():
        token_idx, slot = torch.where(indices == e)
        gate, up = linear(x[token_idx], gate_up[e]).chunk(2, dim=-1)
        y = linear(act(gate) * up, down[e]) * weights[token_idx, slot, None]
        out = out.index_add(0, token_idx, y.to(out.dtype))
    return out


# -------------------------------------------------------------------------------- self-test


def _needle(
    op: str, fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, sizes=(1, 3, 17)
) -> None:
    """fn on a needle row alone must equal fn on it inside batches of `sizes` at every slot."""
    alone = fn(rows[:1])
    for m in sizes:
        for slot in {0, m - 1}:
            batch = rows[1 : m + 1].clone()
            batch[slot] = rows[0]
            if not torch.equal(fn(batch)[slot : slot + 1], alone):
                raise BatchInvariantUnsupported(
                    f"{op}: row results depend on the batch on this machine "
                    f"(a row alone differs from the same row at slot {slot} of {m})"
                )


_checked: set[tuple[torch.dtype, str, int]] = set()


def check_machine(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
    """Start-up self-test of every op here on this machine and dtype; raises
    BatchInvariantUnsupported naming the first op whose rows depend on the batch. A pass is
    remembered per (dtype, device, thread count) for the life of the process."""
    device = torch.device(device)
    key = (dtype, str(device), torch.get_num_threads())
    if key in _checked:
        return
    _check(dtype, device)
    _checked.add(key)


def _check(dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator(device="cpu").manual_seed(1234)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    hidden, out, vocab, heads, kvh, dim = 96, 160, 1000, 4, 2, 32
    rows = rand(40, hidden)
    w, bias = rand(out, hidden), rand(out)
    _needle("linear", lambda x: linear(x, w, bias), rows)
    full = linear(rows, w)
    if not torch.equal(full[:, :64], linear(rows, w[:64])):
        raise BatchInvariantUnsupported("linear: a split weight's columns differ from the fused")
    gate_w, odd_w = rand(1, hidden), rand(8, 33)  # one output (a shared-expert gate), odd K
    _needle("linear", lambda x: linear(x, gate_w), rows)
    _needle("linear", lambda x: linear(x, odd_w), rand(40, 33))
    _thread_check("linear", lambda: linear(rows, w))
    norm_w = rand(hidden)
    _needle("rms_norm", lambda x: rms_norm(x, norm_w, 1e-6), rows)
    logits = rand(40, vocab)
    _needle("log_softmax", lambda x: log_softmax(x, 0.7), logits)
    router_w, gate_up, down = rand(6, hidden), rand(6, 32, hidden), rand(6, hidden, 16)

    def moe(x: torch.Tensor) -> torch.Tensor:
        wts, idx = router(x, router_w, 2, True)
        return moe_experts(x, wts, idx, gate_up, down)

    _needle("moe", moe, rows)
    _check_attention(rand, heads, kvh, dim)


def _thread_check(op: str, fn: Callable[[], torch.Tensor]) -> None:
    threads = torch.get_num_threads()
    want = fn()
    for t in {1, threads}:
        torch.set_num_threads(t)
        try:
            got = fn()
        finally:
            torch.set_num_threads(threads)
        if not torch.equal(got, want):
            raise BatchInvariantUnsupported(f"{op}: results depend on the thread count ({t})")


def _check_attention(rand: Callable[..., torch.Tensor], heads: int, kvh: int, dim: int) -> None:
    """A query at position p: in a 1-row decode, inside a long prefill chunk, and in a batch
    padded to a longer context must give the same bits."""
    length = 45
    q, k, v = rand(1, length, heads, dim), rand(1, length, kvh, dim), rand(1, length, kvh, dim)
    pos = torch.arange(length, device=q.device)[None]
    scale = dim**-0.5
    dense = attention(q, k, v, pos, scale)
    for p in (0, 16, length - 1):
        one = attention(q[:, p : p + 1], k[:, : p + 1], v[:, : p + 1], pos[:, p : p + 1], scale)
        chunk = attention(q[:, 3 : p + 1], k[:, : p + 1], v[:, : p + 1], pos[:, 3 : p + 1],
                          scale) if p >= 3 else one  # fmt: skip
        kb = torch.cat([k, rand(1, length, kvh, dim)], 1).expand(3, -1, -1, -1)
        vb = torch.cat([v, rand(1, length, kvh, dim)], 1).expand(3, -1, -1, -1)
        lens = torch.tensor([p + 1, 2 * length, length], device=q.device)
        qb = q[:, p : p + 1].expand(3, -1, -1, -1)
        batched = attention(qb, kb, vb, pos[:, p : p + 1].expand(3, -1), scale, k_lens=lens)
        want = dense[:, p : p + 1]
        if not (torch.equal(one, want) and torch.equal(chunk[:, -1:], want)
                and torch.equal(batched[:1], want)):  # fmt: skip
            raise BatchInvariantUnsupported(
                f"attention: position {p} differs between decode, prefill chunk and dense"
            )
