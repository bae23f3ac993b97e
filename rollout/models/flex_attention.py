"""Paged attention through PyTorch's FlexAttention (`attention_backend="flex"`).

The torch backend (rollout.models.attention) runs one SDPA call per prefill chunk and gathers
decode K/V into padded copies; on a GPU both are launch- and copy-bound. Here each layer makes
at most two calls, neither of which copies K/V:

- prefill: every prefill chunk of the step (prefix-cache hits and later chunks included) in ONE
  call. Their queries are packed into one sequence, each chunk padded to whole query tiles of
  `Q_TILE` rows so that no tile spans two sequences; the keys are the whole KV pool of the layer
  seen as one long sequence of slots. The block mask lists, per query tile, the pool blocks of
  its sequence: the blocks wholly before the tile's first position as *full* (no mask
  evaluated), those up to its last position as *partial*. The kernel reads only those blocks;
- decode: every one-token row in one call, one batch entry per row against the same pool
  (broadcast over the batch): per row, its blocks but the last are full and the last partial.
  Compiled on CUDA this is FlexAttention's split-KV decoding kernel, the GQA group sharing each
  K/V read. Shared prefixes (GRPO groups) read their blocks through each row's table: no copy,
  but no cross-row reuse either (the torch backend's cascade path does that on CPU).

The mask_mod maps a pool slot back to a position: `p2l[block]` is a block's logical index in
the tables that hold it, which is one number because prefix-cache sharing is position-aligned
(a cached block is only reused at the depth of its verified parent chain; rollout.engine.
block_manager). A slot is visible to a query of sequence s at position p iff its block is in
s's table at that index and `index * block_size + offset <= p`. The mask is exact everywhere,
not only in the listed blocks, because eager flex_attention (CPU tests) ignores the block lists
and evaluates the mask over the whole pool; compiled, only the partial blocks evaluate it.

Compiled (CUDA) the kernel tiles keys by `BLOCK_N`, which must divide the engine's block size
(so block_size must be a multiple of 16 there). On CPU the calls run eagerly: inductor's C++
flex template fails to build this mask (a CppCompileError in torch 2.13), and eager flex
materialises [rows, heads, pool] scores: right for tests, far too slow for CPU serving, where
the torch backend stays the default.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # an old torch: the flex backend is refused at engine start
    BlockMask = flex_attention = None  # type: ignore[assignment,misc]

Q_TILE = 128  # query rows per block-mask tile, compiled: a multiple of the kernels' BLOCK_M
EAGER_Q_TILE = 16  # eager flex ignores the tiles: pad each chunk less


def flex_available() -> bool:
    """Whether this torch ships FlexAttention."""
    return flex_attention is not None


@dataclass
class FlexPrefill:
    """All prefill chunks of a step packed into one query sequence of `gather.numel()` rows."""

    gather: torch.Tensor  # [P] flattened-batch row of each packed row (padding repeats a row)
    real: torch.Tensor  # [n] packed rows that are real queries
    out_rows: torch.Tensor  # [n] their flattened-batch rows
    block_mask: BlockMask


@dataclass
class FlexDecode:
    """One-token rows, one batch entry each."""

    rows: torch.Tensor | None  # flattened-batch rows; None = every row, in order
    block_mask: BlockMask


@dataclass
class FlexPlan:
    """Everything a step's layers share: computed once per forward from the metadata."""

    slot_mapping: torch.Tensor
    decode: FlexDecode | None
    prefill: FlexPrefill | None
    compiled: bool


def _paged_mask(
    p2l: torch.Tensor,
    tables: torch.Tensor,
    row_seq: torch.Tensor | None,
    row_pos: torch.Tensor,
    block_size: int,
    by_batch: bool,
) -> Callable:
    """mask_mod: query row r (the batch index when `by_batch`, else the query index) belongs to
    sequence `row_seq[r]` (r itself when None) at position `row_pos[r]`; key `kv` is pool slot
    kv. True iff that slot holds a position <= the query's in the query's sequence."""

    def mask_mod(b, h, q_idx, kv_idx):
        r = b if by_batch else q_idx
        seq = r if row_seq is None else row_seq[r]
        block = kv_idx // block_size
        logical = p2l[block]
        # the bound from the tensor, not a python int: a new width must not recompile
        own = tables[seq, logical.clamp(0, tables.shape[1] - 1)] == block
        return (logical >= 0) & own & (logical * block_size + kv_idx % block_size <= row_pos[r])

    return mask_mod


def physical_to_logical(
    tables: torch.Tensor, nblocks: torch.Tensor, pool_blocks: int
) -> torch.Tensor:
    """[pool_blocks] logical index of each block in the tables that hold it (-1: none).
    tables [B, W]; entries at or past a row's `nblocks` are padding and ignored."""
    width = tables.shape[1]
    index = torch.arange(width, device=tables.device).expand_as(tables)
    valid = index < nblocks[:, None]
    p2l = torch.full((pool_blocks + 1,), -1, dtype=torch.int32, device=tables.device)
    dest = torch.where(valid, tables, pool_blocks).reshape(-1).long()
    p2l.scatter_(0, dest, torch.where(valid, index, -1).reshape(-1).to(torch.int32))
    return p2l[:pool_blocks]


def check_position_aligned(tables: torch.Tensor, nblocks: torch.Tensor, p2l: torch.Tensor) -> None:
    """ValueError unless every block sits at one logical index in all the tables (host tensors)."""
    index = torch.arange(tables.shape[1]).expand_as(tables)
    valid = index < nblocks[:, None]
    bad = valid & (p2l[tables.clamp(0, p2l.numel() - 1)] != index)
    if bool(bad.any()):
        seq, at = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"flex attention: block {int(tables[seq, at])} is at logical index {at} of "
            f"sequence {seq} but elsewhere at another index; shared blocks must be "
            f"position-aligned (as the prefix cache shares them)"
        )


def _block_mask(
    kv_num: torch.Tensor,
    kv_idx: torch.Tensor,
    full_num: torch.Tensor,
    full_idx: torch.Tensor,
    tile: tuple[int, int],
    mask_mod: Callable,
    q_len: int,
    kv_len: int,
) -> BlockMask:
    """A BlockMask from [B, tiles] counts and [B, tiles, W] indices (one head dimension);
    tile = (query rows, keys) per block."""
    i32 = torch.int32
    return BlockMask.from_kv_blocks(
        kv_num[:, None].to(i32), kv_idx[:, None].to(i32), full_num[:, None].to(i32),
        full_idx[:, None].to(i32), BLOCK_SIZE=tile, mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len), compute_q_blocks=False,
    )  # fmt: skip


def decode_block_mask(
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    p2l: torch.Tensor,
    block_size: int,
    pool_blocks: int,
) -> BlockMask:
    """Decode rows (device tensors, no host work: CUDA-graph safe): row b attends to the
    `context_lens[b]` first positions of `tables[b]`; all its blocks but the last are full."""
    full = ((context_lens - 1) // block_size).long()  # blocks before the new token's
    last = tables.gather(1, full[:, None])
    partial = torch.zeros_like(tables)
    partial[:, :1] = last
    mask = _paged_mask(p2l, tables, None, context_lens - 1, block_size, by_batch=True)
    ones = torch.ones_like(full)
    return _block_mask(ones[:, None], partial[:, None], full[:, None], tables[:, None],
                       (Q_TILE, block_size), mask, 1, pool_blocks * block_size)  # fmt: skip


def _decode_part(
    rows: list[int], all_rows: bool, tables: torch.Tensor, ctx: torch.Tensor, p2l: torch.Tensor,
    block_size: int, pool_blocks: int, device: torch.device,
) -> FlexDecode:  # fmt: skip
    mask = decode_block_mask(tables.to(device), ctx.to(device), p2l, block_size, pool_blocks)
    index = None if all_rows else torch.tensor(rows, dtype=torch.long, device=device)
    return FlexDecode(index, mask)


def _prefill_part(
    starts: list[int], q_lens: list[int], ctx: list[int], tables: torch.Tensor,
    p2l: torch.Tensor, block_size: int, pool_blocks: int, device: torch.device, q_tile: int,
) -> FlexPrefill:  # fmt: skip
    """Pack the chunks tile by tile (host tensors, then one copy each to the device)."""
    q = torch.tensor(q_lens)
    c = torch.tensor(ctx)
    first_row = torch.tensor(starts)
    tiles = -(-q // q_tile)
    n = len(q_lens)
    # packed rows: sequence, offset in its chunk (padding rows repeat the chunk's last row)
    padded = tiles * q_tile
    seq = torch.repeat_interleave(torch.arange(n), padded)
    offset = torch.arange(int(padded.sum())) - torch.repeat_interleave(
        padded.cumsum(0) - padded, padded
    )
    k = torch.minimum(offset, q[seq] - 1)
    gather = first_row[seq] + k
    pos = c[seq] - q[seq] + k
    real = (offset < q[seq]).nonzero().flatten()
    # tiles: blocks wholly before the first position are full, the rest up to the last partial
    tile_seq = torch.repeat_interleave(torch.arange(n), tiles)
    t = torch.arange(len(tile_seq)) - torch.repeat_interleave(tiles.cumsum(0) - tiles, tiles)
    first = c[tile_seq] - q[tile_seq] + t * q_tile
    last = torch.minimum(first + q_tile - 1, c[tile_seq] - 1)
    full = (first + 1) // block_size
    part = last // block_size + 1 - full
    width = tables.shape[1]
    own = tables[tile_seq]
    shift = (full[:, None] + torch.arange(width)).clamp(max=width - 1)
    partial = own.gather(1, shift)
    to = functools.partial(torch.Tensor.to, device=device, non_blocking=True)
    tables_d, seq_d, pos_d = to(tables), to(seq), to(pos)
    mask = _paged_mask(p2l, tables_d, seq_d, pos_d, block_size, by_batch=False)
    block_mask = _block_mask(to(part)[None], to(partial)[None], to(full)[None], to(own)[None],
                             (q_tile, block_size), mask, len(seq), pool_blocks * block_size)  # fmt: skip
    return FlexPrefill(to(gather), to(real), to(gather[real]), block_mask)


def plan_flex(
    q_lens: list[int],
    ctx: list[int],
    starts: list[int],
    tables: Sequence[Sequence[int]],
    block_size: int,
    pool_blocks: int,
    slot_mapping: torch.Tensor,
    compiled: bool | None = None,
) -> FlexPlan:
    """The flex plan of one step (python lists in, as rollout.models.attention reads them).
    compiled: whether the kernels run compiled (None: on CUDA)."""
    if not flex_available():
        raise RuntimeError("attention_backend='flex' needs torch.nn.attention.flex_attention")
    device = slot_mapping.device
    if compiled is None:
        compiled = device.type == "cuda"
    width = max((len(t) for t in tables), default=1) or 1
    host = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables],
                        dtype=torch.long).view(len(tables), width)  # fmt: skip
    nblocks = torch.tensor([-(-c // block_size) for c in ctx])
    p2l_host = physical_to_logical(host, nblocks, pool_blocks)
    check_position_aligned(host, nblocks, p2l_host)
    p2l = p2l_host.to(device, non_blocking=True)
    dec = [i for i, q in enumerate(q_lens) if q == 1]
    pre = [i for i, q in enumerate(q_lens) if q > 1]
    decode = prefill = None
    if dec:
        sel = torch.tensor(dec)
        decode = _decode_part([starts[i] for i in dec], len(dec) == len(q_lens), host[sel],
                              torch.tensor([ctx[i] for i in dec]), p2l, block_size,
                              pool_blocks, device)  # fmt: skip
    if pre:
        prefill = _prefill_part([starts[i] for i in pre], [q_lens[i] for i in pre],
                                [ctx[i] for i in pre], host[torch.tensor(pre)], p2l,
                                block_size, pool_blocks, device,
                                Q_TILE if compiled else EAGER_Q_TILE)  # fmt: skip
    return FlexPlan(slot_mapping.long(), decode, prefill, bool(compiled))


# Three compiled entry points, each its own code object so their dynamo caches stay apart:
# prefill lengths change every step (dynamic shapes); graph-captured decode has one fixed batch
# per bucket (static: FlexAttention's decoding kernel needs a static batch); decode outside the
# graphs (mixed steps, graphs off) takes whatever batch and width come (dynamic once they vary).
def _prefill_entry(*args, **kwargs):
    return flex_attention(*args, **kwargs)


def _graph_decode_entry(*args, **kwargs):
    return flex_attention(*args, **kwargs)


def _decode_entry(*args, **kwargs):
    return flex_attention(*args, **kwargs)


_ENTRIES = {"prefill": (_prefill_entry, True), "graph_decode": (_graph_decode_entry, False),
            "decode": (_decode_entry, None)}  # fmt: skip


@functools.cache
def _compiled(kind: str) -> Callable:
    # up to 20 batch buckets compile the graph decode once each
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    fn, dynamic = _ENTRIES[kind]
    return torch.compile(fn, dynamic=dynamic, fullgraph=True)


def _kernel_options(block_size: int) -> dict:
    """Key tiles must divide the block size, in the main kernel (prefill, and decode with a
    dynamic batch) and the decoding kernel alike; the default configs' 64/128 would not."""
    return {"BLOCK_N": math.gcd(block_size, 64)}


def _flex(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, block_mask: BlockMask,
          scale: float, compiled: bool, kind: str) -> torch.Tensor:  # fmt: skip
    gqa = q4.shape[1] != k4.shape[1]
    if not compiled:
        return flex_attention(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    options = _kernel_options(block_mask.BLOCK_SIZE[1])
    return _compiled(kind)(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                           kernel_options=options)  # fmt: skip


def _pool_as_sequence(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, KVH, D] -> [1, KVH, blocks * block_size, D], a view (no copy)."""
    return cache.flatten(0, 1).transpose(0, 1).unsqueeze(0)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """The new tokens' K/V into their pool slots (before attention reads them)."""
    if k_cache.dtype != k.dtype:
        raise ValueError(
            f"flex attention reads the KV pool as it is: its dtype {k_cache.dtype} must be the "
            f"model's {k.dtype}"
        )
    kvh, dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, dim).index_copy_(0, slot_mapping, v)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_mask: BlockMask, scale: float, compiled: bool,
                     graph: bool = False) -> torch.Tensor:  # fmt: skip
    """q [B, H, D], one token per row -> [B, H, D] through `block_mask`'s rows; `graph`: a
    CUDA-graph step (static shapes)."""
    k4, v4 = _pool_as_sequence(k_cache), _pool_as_sequence(v_cache)
    kind = "graph_decode" if graph else "decode"
    return _flex(q.unsqueeze(2), k4, v4, block_mask, scale, compiled, kind).squeeze(2)


def flex_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: FlexPlan,
    scale: float,
) -> torch.Tensor:
    """`rollout.models.attention.paged_attention` for a flex plan: q [N, H, D], k/v [N, KVH, D]
    (new tokens), caches [blocks, block_size, KVH, D] -> [N, H, D]."""
    write_kv(k, v, k_cache, v_cache, plan.slot_mapping)
    d, p = plan.decode, plan.prefill
    if d is not None and d.rows is None:  # a pure decode step
        return decode_attention(q, k_cache, v_cache, d.block_mask, scale, plan.compiled)
    out = torch.empty_like(q)
    if d is not None:
        qd = q.index_select(0, d.rows)
        out.index_copy_(0, d.rows, decode_attention(qd, k_cache, v_cache, d.block_mask, scale,
                                                    plan.compiled))  # fmt: skip
    if p is not None:
        qp = q.index_select(0, p.gather).transpose(0, 1).unsqueeze(0)  # [1, H, P, D]
        k4, v4 = _pool_as_sequence(k_cache), _pool_as_sequence(v_cache)
        op = _flex(qp, k4, v4, p.block_mask, scale, plan.compiled, "prefill")
        out.index_copy_(0, p.out_rows, op[0].transpose(0, 1).index_select(0, p.real))
    return out
