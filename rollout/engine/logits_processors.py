"""vLLM's logits parameters, applied per request before the sampler draws.

Order (vLLM's): the masks (allowed_token_ids, bad_words, min_tokens) -> logit_bias -> the
repetition, frequency and presence penalties -> [sampler: temperature] -> min_p -> top-k/top-p.

What a processor reads besides the parameters comes from the request's own tokens: the prompt
it first arrived with and everything it generated since (`RequestLogits.tokens` is the engine
Sequence's token list). A request resumed after eviction, recompute, suspend or re-dispatch to
another engine is admitted again from its record, which holds the same tokens, so its counts
are rebuilt from them: nothing else has to survive.

Log-probs (rollout.sampling.logprobs_temperature) are of one of two distributions:
- raw: log_softmax(model logits), untouched by anything here;
- processed: log_softmax(processed logits / T), after the masks, the bias and the penalties,
  before the truncations (min_p, top-k, top-p). `process` recomputes the processed logits of
  a finished sequence from a trainer's own logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rollout.engine.errors import RequestError
from rollout.sampling import SamplingParams
from rollout.tokenizers import tokenize_with

PROCESSORS = {"min_tokens": 0, "logit_bias": None, "allowed_token_ids": None, "bad_words": [],
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # fmt: skip


def processors_of(sp: SamplingParams) -> list[str]:
    """The names of the parameters of `sp` that reshape its logits (not at their default)."""
    return [name for name, off in PROCESSORS.items() if (v := getattr(sp, name)) and v != off]


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word as it starts the text and, when that is a
    different token sequence of the same length, as it follows a space."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenize_with(tokenizer, word.lstrip(), bos=False)
        out.append(plain)
        spaced = tokenize_with(tokenizer, " " + word.lstrip(), bos=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


class RequestLogits:
    """One request's processors: its parameters, the token-id sets they name, and running
    counts of its tokens (brought up to date from `tokens` before each use)."""

    def __init__(self, sp: SamplingParams, bad_words: list[list[int]], stop_ids: list[int]) -> None:
        self.sp = sp
        self.banned = sorted({w[0] for w in bad_words if len(w) == 1})
        self.bad_sequences = [w for w in bad_words if len(w) > 1]
        self.stop_ids = stop_ids  # banned until min_tokens
        self.tokens: list[int] = []
        self.prompt_len = 0
        self._seen = 0
        self._rep: dict[int, None] = {}  # prompt and generated ids (ordered set)
        self._out: dict[int, int] = {}  # generated id -> count
        self._device: dict[torch.device, dict[str, torch.Tensor]] = {}

    @classmethod
    def for_request(
        cls, sp: SamplingParams, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]
    ) -> RequestLogits | None:
        """The processors of `sp` (None when it has none); RequestError naming the parameter
        when it cannot be honoured on this engine."""
        if not sp.processes_logits:
            return None
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(sp, name) or ()
            if bad := [t for t in ids if t >= vocab_size]:
                raise RequestError(f"{name}: token id {bad[0]} is out of range for vocab_size "
                                   f"{vocab_size}")  # fmt: skip
        bad_words: list[list[int]] = []
        if sp.bad_words:
            if tokenizer is None:
                raise RequestError("bad_words need a tokenizer")
            bad_words = bad_words_token_ids(tokenizer, sp.bad_words)
        stop_ids = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids)))
        state = cls(sp, bad_words, stop_ids)
        if sp.allowed_token_ids is not None:
            left = set(sp.allowed_token_ids) - set(state.banned)
            if not left or (sp.min_tokens and not left - set(stop_ids)):
                raise RequestError("allowed_token_ids: every allowed token is banned by "
                                   "bad_words or min_tokens")  # fmt: skip
        return state

    def attach(self, tokens: list[int], prompt_len: int) -> RequestLogits:
        """Count from `tokens` (the live list the engine appends to); the first `prompt_len`
        are the prompt the request first arrived with."""
        self.tokens, self.prompt_len, self._seen = tokens, prompt_len, 0
        self._rep, self._out = {}, {}
        return self

    @property
    def needs_history(self) -> bool:
        """Reads tokens sampled in the step before (so that step must have reached the host)."""
        sp = self.sp
        return bool(
            sp.min_tokens
            or self.bad_sequences
            or sp.presence_penalty
            or sp.frequency_penalty
            or sp.repetition_penalty != 1.0
        )

    def _update(self) -> None:
        for i in range(self._seen, len(self.tokens)):
            t = self.tokens[i]
            self._rep[t] = None
            if i >= self.prompt_len:
                self._out[t] = self._out.get(t, 0) + 1
        self._seen = len(self.tokens)

    def banned_now(self) -> list[int]:
        """Token ids banned at the next position: single-token bad words, the last token of a
        bad word whose other tokens were just generated, and the stop ids before min_tokens."""
        out = list(self.banned)
        generated = self.tokens[self.prompt_len :]
        for word in self.bad_sequences:
            n = len(word) - 1
            if len(generated) >= n and generated[len(generated) - n :] == word[:n]:
                out.append(word[-1])
        if len(generated) < self.sp.min_tokens:
            out += self.stop_ids
        allowed = self.sp.allowed_token_ids
        if allowed is not None and out and set(allowed) <= set(out):
            raise ValueError("allowed_token_ids: every allowed token is banned at this position")
        return out

    def cached(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The fixed id sets of this request on `device` (made once)."""
        if device not in self._device:
            sp, c = self.sp, {}
            if sp.allowed_token_ids is not None:
                c["allowed"] = _on(device, sp.allowed_token_ids, torch.int64)
            if sp.logit_bias:
                c["bias_ids"] = _on(device, list(sp.logit_bias), torch.int64)
                c["bias"] = _on(device, list(sp.logit_bias.values()), torch.float32)
            self._device[device] = c
        return self._device[device]


def apply(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    states: Sequence[RequestLogits | None] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits to sample from, logits the log-probs are computed from) for float logits [B, V]:
    the processed logits, and per row the processed ones where its logprobs_mode is
    "processed", else the model's. Both are `logits` itself when no row has a processor."""
    if not states or all(s is None for s in states):
        return logits, logits
    x = process_rows(logits.clone(), states)
    modes = [p.logprobs_mode == "processed" and s is not None for p, s in zip(params, states, strict=True)]  # fmt: skip
    if not any(modes):
        return x, logits
    if all(modes):
        return x, x
    pick = _on(logits.device, modes, torch.bool)[:, None]
    return x, torch.where(pick, x, logits)


def process_rows(x: torch.Tensor, states: Sequence[RequestLogits | None]) -> torch.Tensor:
    """Every row's processors on float logits [B, V], in place: each stage is one indexed
    update over the (row, token) pairs of all rows, so a step costs a few kernels whatever the
    batch size. Pairs within one stage are distinct (each row's ids are a set)."""
    dev, inf = x.device, float("-inf")
    rows = [(i, s) for i, s in enumerate(states) if s is not None]
    for _, s in rows:
        s._update()
    allowed = [(i, s.cached(dev)["allowed"]) for i, s in rows if s.sp.allowed_token_ids]
    if allowed:
        keep = torch.full((len(allowed), x.shape[1]), inf, dtype=x.dtype, device=dev)
        r, t = _pairs([(j, ids) for j, (_, ids) in enumerate(allowed)], dev)
        keep[r, t] = 0.0
        x[_on(dev, [i for i, _ in allowed], torch.int64)] += keep
    banned = [(i, b) for i, s in rows if (b := s.banned_now())]
    if banned:
        x[_pairs(banned, dev)] = inf
    bias = [(i, s) for i, s in rows if s.sp.logit_bias]
    if bias:
        r, t = _pairs([(i, s.cached(dev)["bias_ids"]) for i, s in bias], dev)
        x.index_put_((r, t), torch.cat([s.cached(dev)["bias"] for _, s in bias]), accumulate=True)
    rep = [(i, s) for i, s in rows if s.sp.repetition_penalty != 1.0 and s._rep]
    if rep:
        r, t = _pairs([(i, list(s._rep)) for i, s in rep], dev)
        pen = _on(dev, [s.sp.repetition_penalty for _, s in rep], x.dtype)
        pen = pen.repeat_interleave(_on(dev, [len(s._rep) for _, s in rep], torch.int64))
        v = x[r, t]
        x[r, t] = torch.where(v > 0, v / pen, v * pen)
    freq = [(i, s) for i, s in rows if (s.sp.frequency_penalty or s.sp.presence_penalty) and s._out]
    if freq:
        r, t = _pairs([(i, list(s._out)) for i, s in freq], dev)
        counts = _on(dev, [c for _, s in freq for c in s._out.values()], x.dtype)
        fp = _on(dev, [(s.sp.frequency_penalty, s.sp.presence_penalty) for _, s in freq], x.dtype)
        fp = fp.repeat_interleave(_on(dev, [len(s._out) for _, s in freq], torch.int64), dim=0)
        x.index_put_((r, t), -(fp[:, 0] * counts + fp[:, 1]), accumulate=True)
    return x


def _pairs(
    ids_per_row: list[tuple[int, list[int] | torch.Tensor]], dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors on `dev` of every (row, ids) given: host lists are joined
    on the host (one copy each), device tensors (the cached id sets) on the device."""
    if isinstance(ids_per_row[0][1], list):
        rows = [i for i, ids in ids_per_row for _ in ids]
        toks = [t for _, ids in ids_per_row for t in ids]
        return _on(dev, rows, torch.int64), _on(dev, toks, torch.int64)
    lengths = _on(dev, [len(ids) for _, ids in ids_per_row], torch.int64)
    rows = _on(dev, [i for i, _ in ids_per_row], torch.int64).repeat_interleave(lengths)
    return rows, torch.cat([ids for _, ids in ids_per_row])


def min_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Drop, per row, the tokens whose probability under `x` (logits after temperature) is
    below min_p x the row's top probability."""
    ps = [p.min_p for p in params]
    if not any(ps):
        return x
    probs = torch.softmax(x, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * _on(x.device, ps, x.dtype)[:, None]
    return x.masked_fill(probs < floor, float("-inf"))


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small host list on `device`; on CUDA through pinned memory, as `sampler.to_device`
    (which imports this module), so the copy queues behind the step instead of syncing."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type != "cuda" else t.pin_memory().to(device, non_blocking=True)


def process(
    logits: torch.Tensor,
    sp: SamplingParams,
    prompt: Sequence[int],
    completion: Sequence[int],
    tokenizer: Any = None,
    eos_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """A trainer's recomputation of the processed logits: `logits` [len(completion), V] predict
    each completion token (row j after prompt + completion[:j]); returns them processed as the
    engine processed them when it sampled. log_softmax(result / T) is then the "processed"
    behaviour log-prob, exactly. `eos_ids`: the engine's (min_tokens bans them)."""
    state = RequestLogits.for_request(sp, tokenizer, logits.shape[-1], eos_ids)
    if state is None:
        return logits
    tokens = list(prompt)
    state.attach(tokens, len(prompt))
    out = logits.float().clone()
    for j, t in enumerate(completion):
        process_rows(out[j : j + 1], [state])
        tokens.append(int(t))
    return out
