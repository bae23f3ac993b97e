"""The `logprobs` object of a completion choice, prompt included when echoed, as vLLM returns it.

Scoring clients (lm-eval's `local-completions`) send `echo: true, logprobs: k` and read the
log-prob of every prompt token: the first prompt token has none (nothing precedes it), so its
entries are None. Each top-log-probs dict holds the top k and the token itself, as in vLLM.
`text_offset` is the character offset in the returned `text` (prompt first when echoed) at which
each token's text begins. A prompt is scored once for all its n choices (`engine_choices`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.detokenizer import TextOffsets
from rollout.sampling import SamplingParams

Decode = Callable[[list[int]], str]


def _tops(
    decode: Decode, tokens: list[int], lps: list[float], tops: list[dict[int, float]]
) -> list[dict[str, float]]:
    out = []
    for t, lp, top in zip(tokens, lps, tops, strict=True):
        entry = {decode([k]): v for k, v in top.items()}
        entry.setdefault(decode([t]), lp)
        out.append(entry)
    return out


def token_logprobs(
    decode: Decode, tokens: list[int], lps: list[float], tops: list[dict[int, float]],
    offsets: TextOffsets,
) -> dict[str, list]:  # fmt: skip
    """The `logprobs` object of generated `tokens` (`tops`: one dict per token), their text
    offsets continuing `offsets` (a stream's chunks continue where the last ended)."""
    return {"tokens": [decode([t]) for t in tokens], "token_logprobs": list(lps),
            "top_logprobs": _tops(decode, tokens, lps, tops),
            "text_offset": offsets(tokens)}  # fmt: skip


def completion_logprobs(
    decode: Decode, prompt: list[int] | None, rec: Any, gen_tops: list[dict[int, float]]
) -> dict[str, list]:
    """`rec`'s log-probs: those of the `prompt` first when it is given (echo), then those of the
    generated tokens with their top log-probs `gen_tops` (one per token; none at all: max_tokens
    0, scoring only)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}  # fmt: skip
    prompt_text = ""
    if prompt is not None:
        prompt_lps = list(rec.prompt_log_probs or [])
        if len(prompt_lps) != len(prompt) - 1:
            raise ValueError(f"{len(prompt_lps)} prompt log-probs for {len(prompt)} tokens")
        ptops = list(rec.prompt_top_n_logprobs or [{}] * len(prompt_lps))
        out = token_logprobs(decode, prompt, [None, *prompt_lps], [{}, *ptops],
                             TextOffsets(decode))  # fmt: skip
        out["top_logprobs"][0] = None  # nothing precedes the first token
        prompt_text = decode(prompt)
    gen = list(rec.generated_tokens) if gen_tops else []
    if gen:
        part = token_logprobs(decode, gen, list(rec.generated_log_probs), gen_tops,
                              TextOffsets(decode, len(prompt_text)))  # fmt: skip
        for k in out:
            out[k] += part[k]
    return out


def engine_choices(req: Any, sps: list[SamplingParams]) -> list[SamplingParams]:
    """The choices the engines run for each prompt. A prompt's log-probs are the same for all
    its n choices, so they are computed once: scoring only (echo, max_tokens 0: nothing is
    generated, every choice is the same) runs one choice, which all n repeat; echo with
    generation runs n, the first alone asking for the prompt's log-probs (`share_prompt_scores`)."""
    if not getattr(req, "echo", False):
        return sps
    if req.scores_only():
        return sps[:1]
    return [sps[0], *(sp.replace(return_prompt_log_probs=False) for sp in sps[1:])]


def share_prompt_scores(records: list[Any], n: int, ran: int) -> list[Any]:
    """The n records of each prompt from the `ran` the engines ran for it (engine_choices): the
    first one's prompt log-probs given to the others, or repeated n times."""
    out = []
    for start in range(0, len(records), ran):
        group = records[start : start + ran]
        if ran == 1:
            out += group * n
            continue
        for rec in group[1:]:
            rec.prompt_log_probs = group[0].prompt_log_probs
            rec.prompt_top_n_logprobs = group[0].prompt_top_n_logprobs
        out += group
    return out
