"""The `logprobs` object of a completion choice, prompt included when echoed, as vLLM returns it.

Scoring clients (lm-eval's `local-completions`) send `echo: true, logprobs: k` and read the
log-prob of every prompt token: the first prompt token has none (nothing precedes it), so its
entries are None. Each top-log-probs dict holds the top k and the token itself, as in vLLM.
`text_offset` is the character offset in the returned `text` (prompt first when echoed) at which
each token's text begins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.detokenizer import text_offsets

Decode = Callable[[list[int]], str]


def _tops(
    decode: Decode, tokens: list[int], lps: list[float], tops: list[dict[int, float]] | None
) -> list[dict[str, float]]:
    out = []
    for i, (t, lp) in enumerate(zip(tokens, lps, strict=True)):
        top = tops[i] if tops else {}
        entry = {decode([k]): v for k, v in top.items()}
        entry.setdefault(decode([t]), lp)
        out.append(entry)
    return out


def completion_logprobs(
    decode: Decode, prompt: list[int] | None, rec: Any, gen_tops: list[dict[int, float]]
) -> dict[str, list]:
    """`rec`'s log-probs: those of the `prompt` first when it is given (echo), then those of the
    generated tokens with their top log-probs `gen_tops` (one per token; none at all: max_tokens
    0, scoring only)."""
    tokens: list[int] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    prompt_text = ""
    if prompt is not None:
        prompt_lps = list(rec.prompt_log_probs or [])
        if len(prompt_lps) != len(prompt) - 1:
            raise ValueError(f"{len(prompt_lps)} prompt log-probs for {len(prompt)} tokens")
        tokens += prompt
        lps += [None, *prompt_lps]
        tops += [None, *_tops(decode, prompt[1:], prompt_lps, rec.prompt_top_n_logprobs)]
        prompt_text = decode(prompt)
    gen = list(rec.generated_tokens) if gen_tops else []
    if gen:
        gen_lps = list(rec.generated_log_probs)
        tokens += gen
        lps += gen_lps
        tops += _tops(decode, gen, gen_lps, gen_tops)
    offsets = text_offsets(decode, list(prompt or []))
    offsets += text_offsets(decode, gen, start=len(prompt_text))
    return {"tokens": [decode([t]) for t in tokens], "token_logprobs": lps,
            "top_logprobs": tops, "text_offset": offsets}  # fmt: skip
