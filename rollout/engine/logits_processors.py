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

from rollout.engine.intake import RequestError
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
    x = logits.clone()
    for i, state in enumerate(states):
        if state is not None:
            process_row(x[i], state)
    modes = [p.logprobs_mode == "processed" and s is not None for p, s in zip(params, states, strict=True)]  # fmt: skip
    if not any(modes):
        return x, logits
    if all(modes):
        return x, x
    pick = _on(logits.device, modes, torch.bool)[:, None]
    return x, torch.where(pick, x, logits)


def process_row(x: torch.Tensor, state: RequestLogits) -> torch.Tensor:
    """One row's processed logits [V] (in place), from the row's tokens so far."""
    state._update()
    sp, dev = state.sp, x.device
    c = state.cached(dev)
    if "allowed" in c:
        keep = torch.full_like(x, float("-inf"))
        keep[c["allowed"]] = 0.0
        x += keep
    banned = state.banned_now()
    if banned:
        x[_on(dev, banned, torch.int64)] = float("-inf")
    if "bias" in c:
        x.index_add_(0, c["bias_ids"], c["bias"])
    if sp.repetition_penalty != 1.0 and state._rep:
        ids = _on(dev, list(state._rep), torch.int64)
        v = x[ids]
        x[ids] = torch.where(v > 0, v / sp.repetition_penalty, v * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and state._out:
        ids = _on(dev, list(state._out), torch.int64)
        counts = _on(dev, list(state._out.values()), x.dtype)
        x.index_add_(0, ids, -(sp.frequency_penalty * counts + sp.presence_penalty))
    return x


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
    from rollout.engine.sampler import to_device  # (sampler imports this module)

    return to_device(values, dtype, device)


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
        process_row(out[j], state)
        tokens.append(int(t))
    return out
