"""Batched sampling whose randomness belongs to the request, not to the batch.

Each sampled token draws one uniform number from (request seed, absolute position) through
splitmix64 and picks its token by inverse-CDF over the filtered distribution. So a seeded
request yields the same tokens whatever else shares the batch, and across eviction, recompute
or suspend/resume (the position of a token never changes). The draw is plain integer
arithmetic, identical on CPU and CUDA.

Log-probs follow each request's `logprobs_mode`: log_softmax(logits / t) with t its
`logprobs_temperature`, 1 for raw (the model's distribution) and the sampling temperature for
processed (what was sampled from, after the request's logits processors and before min-p,
top-k and top-p: rollout.engine.logits_processors). Either way it is the quantity a trainer
recomputes from its own logits for the behaviour policy. A structured-output row's grammar
mask (rollout.engine.grammar.TokenMask) then sets its disallowed logits to -inf before
sampling; processed log-probs are of that masked distribution (what was sampled from), raw
ones of the model's unmasked logits.

`sample_isolated` keeps one bad row from costing the batch: when the batched call raises, each
row is sampled alone (same tokens: a row's draw depends only on its own logits, params, seed and
position) and only the rows that still raise are reported as faults.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.engine import logits_processors
from rollout.engine.logits_processors import RequestLogits
from rollout.models import batch_invariant as bi
from rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from rollout.engine.grammar import TokenMask

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One round of splitmix64 (a bijective 64-bit mixer)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform float in [0, 1) that depends only on (seed, position)."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * 2.0**-53


@dataclass
class SampleOutput:
    tokens: list[int]
    log_probs: list[float] | None  # log-prob of each sampled token (its logprobs_mode)
    top_n: list[dict[int, float]] | None  # per row, empty dict where not requested


@dataclass
class DeviceSample:
    """One step's samples still on the device: the step after may feed `tokens` to its forward
    before the host reads anything (rollout.engine.overlap). `start_copy` queues the one
    device-to-host transfer; `to_host` waits for it."""

    tokens: torch.Tensor  # [B] int64
    log_probs: torch.Tensor | None  # [B] of each sampled token, when any row wants them
    top: tuple[torch.Tensor, torch.Tensor] | None  # (values, ids) [B, max_n]
    top_ns: list[int]  # per row, how many of `top` it asked for
    _host: list[torch.Tensor] | None = None
    _event: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """Queue the copy into pinned host memory (CUDA), so reading it later waits for this
        step's work only, not for whatever was launched after it."""
        parts = [self.tokens.double()[None]]
        if self.log_probs is not None:
            parts.append(self.log_probs.double()[None])
        packed = [torch.cat(parts)]  # tokens and log-probs in one transfer (fp64 holds both)
        if self.top is not None:
            packed += [self.top[0].double(), self.top[1]]
        if self.tokens.device.type != "cuda":
            self._host = packed
            return
        self._host = [t.to("cpu", non_blocking=True) for t in packed]
        self._event = torch.cuda.Event()
        self._event.record()


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    states: Sequence[RequestLogits | None] | None = None,
    mask: TokenMask | None = None,
) -> DeviceSample:
    """logits [B, V] -> one token per row, on the device; nothing waits for the device.
    states: each row's logits processors (None: none); mask: the grammar rows' allowed tokens
    (structured outputs)."""
    logits, lp_logits = logits_processors.apply(logits.float(), params, states)
    if mask is not None:
        logits = mask.apply(logits)
        lp_logits = _logprob_source(mask.apply(lp_logits), lp_logits, params, mask)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        tokens = _argmax(logits)
    else:
        sub = [params[i] for i in rows]
        u = [uniform(seeds[i], positions[i]) for i in rows]
        u = to_device(u, torch.float64, logits.device)
        if len(rows) == len(params):  # every row samples: no argmax, no gather
            tokens = _sample_rows(logits, sub, u)
        else:
            tokens = _argmax(logits)
            idx = to_device(rows, torch.int64, logits.device)
            tokens.index_copy_(0, idx, _sample_rows(logits.index_select(0, idx), sub, u))

    want_lp = any(p.return_log_probs for p in params)
    top_ns = [p.top_n_logprobs for p in params]
    max_n = max(top_ns)
    lp = top = None
    if want_lp or max_n:
        logp = _log_softmax(lp_logits, [p.logprobs_temperature for p in params])
        if want_lp:
            lp = logp.gather(1, tokens[:, None]).squeeze(1)
        if max_n:
            top = logp.topk(min(max_n, logp.shape[-1]), dim=-1)
            top = (top.values, top.indices)
    out = DeviceSample(tokens, lp, top, top_ns)
    out.start_copy()
    return out


def _logprob_source(
    masked: torch.Tensor, model: torch.Tensor, params: Sequence[SamplingParams],
    mask: TokenMask | None,
) -> torch.Tensor:  # fmt: skip
    """The logits each row's log-probs come from: processed rows the masked ones (what was
    sampled from), raw rows the model's own."""
    if mask is None:
        return model
    processed = [params[i].logprobs_mode == "processed" for i in range(len(params))]
    if all(processed):
        return masked
    if not any(processed[i] for i in mask.rows):
        return model
    pick = torch.tensor(processed, device=model.device)[:, None]
    return torch.where(pick, masked, model)


def to_host(sample: DeviceSample) -> SampleOutput:
    """The step's one device-to-host synchronization: wait for the copy, unpack it."""
    if sample._event is not None:
        sample._event.synchronize()
    host = sample._host
    packed = host[0].tolist()
    tokens = [int(t) for t in packed[0]]
    log_probs = packed[1] if sample.log_probs is not None else None
    top_n = None
    if sample.top is not None:
        vals, ids = host[1].tolist(), host[2].tolist()
        top_n = [
            {t: v for t, v in zip(ids[i][:n], vals[i][:n], strict=False) if v > -math.inf}
            for i, n in enumerate(sample.top_ns)
        ]  # fmt: skip (masked tokens: not listed)
    return SampleOutput(tokens, log_probs, top_n)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    states: Sequence[RequestLogits | None] | None = None,
    mask: TokenMask | None = None,
) -> SampleOutput:
    """logits [B, V] -> one token per row. positions: absolute index of the token being sampled."""
    return to_host(sample_on_device(logits, params, seeds, positions, states, mask))


def _log_softmax(logits: torch.Tensor, temps: Sequence[float]) -> torch.Tensor:
    """log_softmax(logits / t) per row ([B, V] and one t per row), skipping the divide at 1:
    rollout.models.batch_invariant's formula, the one the trainer's log-probs use."""
    if all(t == 1.0 for t in temps):
        return bi.log_softmax(logits)
    return bi.log_softmax(logits, to_device(temps, torch.float32, logits.device))


def to_device(
    values: Sequence[float | int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list on `device`; on CUDA through pinned memory, so the copy queues behind
    the step's work instead of waiting for it (a pageable copy synchronizes the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def sample_isolated(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    states: Sequence[RequestLogits | None] | None = None,
    mask: TokenMask | None = None,
) -> tuple[SampleOutput, dict[int, Exception]]:
    """`sample()`, and when the batch raises, every row alone: returns the output and the
    exception of each row that failed on its own (its token is -1, its log-prob None)."""
    try:
        return sample(logits, params, seeds, positions, states, mask), {}
    except Exception:
        pass
    tokens: list[int] = []
    log_probs: list[float | None] = []
    top_n: list[dict[int, float]] = []
    faults: dict[int, Exception] = {}
    for i in range(len(params)):
        try:
            row = sample(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1],
                         positions[i : i + 1], states[i : i + 1] if states else None,
                         mask.row(i) if mask is not None else None)  # fmt: skip
        except Exception as e:
            faults[i], row = e, SampleOutput([-1], None, None)
        tokens.append(row.tokens[0])
        log_probs.append(row.log_probs[0] if row.log_probs else None)
        top_n.append(row.top_n[0] if row.top_n else {})
    return SampleOutput(tokens, log_probs, top_n), faults


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum, like argmax; max(dim) is ~3x faster on CPU."""
    return logits.max(dim=-1).indices


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """Temperature, then top-k and top-p on the sorted distribution, then inverse-CDF with u."""
    device = logits.device
    vocab = logits.shape[-1]
    temps = [p.temperature for p in params]
    x = logits
    if any(t != 1.0 for t in temps):
        x = logits / to_device(temps, logits.dtype, device)[:, None]
    x = logits_processors.min_p(x, params)
    order = None
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # past the vocab: off
    if any(k < vocab or p.top_p < 1.0 for k, p in zip(ks, params, strict=True)):
        x, order = x.sort(dim=-1, descending=True)
        ks = to_device(ks, torch.int64, device)
        x = x.masked_fill(torch.arange(vocab, device=device)[None, :] >= ks[:, None], float("-inf"))
        top_p = to_device([p.top_p for p in params], torch.float64, device)
        probs = torch.softmax(x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop = before >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays, whatever the rounding
        x = x.masked_fill(drop, float("-inf"))
    return _order_pick(_inverse_cdf(torch.softmax(x, dim=-1), u), order)


CDF_BLOCK = 256  # vocab chunk of the two-level inverse CDF


def _order_pick(pick: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    return pick if order is None else order.gather(1, pick[:, None]).squeeze(1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds u * total, per row, in fp64 (so the pick never lands
    on a zero-mass token). Two levels (chunk sums, then one chunk) instead of an fp64 cumsum
    over the whole vocabulary, which cost ~30 ms for 128 rows x 32k on one CPU thread."""
    rows, vocab = probs.shape
    blk = min(CDF_BLOCK, vocab)
    pad = -vocab % blk
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    chunks = probs.view(rows, -1, blk)
    chunk_cdf = chunks.double().sum(-1).cumsum(-1)  # [B, n_chunks] (3x faster than dtype=)
    target = u * chunk_cdf[:, -1]
    c = torch.searchsorted(chunk_cdf, target[:, None], right=True).clamp_(max=chunks.shape[1] - 1)
    before = torch.where(c > 0, chunk_cdf.gather(1, (c - 1).clamp_(min=0)), 0.0)
    chunk = chunks.gather(1, c[:, :, None].expand(rows, 1, blk)).squeeze(1)  # [B, blk]
    local = chunk.double().cumsum(-1) + before
    j = torch.searchsorted(local, target[:, None], right=True)
    # rounding (chunk sum vs running sum) can leave target past the chunk's end: take its last
    # token with mass, never a zero-mass one
    idx = torch.arange(blk, device=probs.device)
    last = torch.where(chunk > 0, idx, -1).amax(-1, keepdim=True)
    j = torch.minimum(j, last)
    return (c * blk + j).squeeze(1).clamp_(max=vocab - 1)


def prompt_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, top_n: int = 0, temperature: float = 1.0
) -> tuple[list[float], list[dict[int, float]]]:
    """logits [T, V] predicting targets [T] -> (log-probs of those targets at `temperature`
    (the request's logprobs_temperature), the top `top_n` {token: log-prob} of each position;
    empty when top_n is 0)."""
    logp = bi.log_softmax(logits, float(temperature))
    lp = logp.gather(1, targets[:, None].to(logp.device)).squeeze(1).tolist()
    if not top_n:
        return lp, []
    vals, ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
    return lp, [
        dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
    ]
