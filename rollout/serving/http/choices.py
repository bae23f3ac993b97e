"""The bodies of /v1 answers: each choice (text or chat message, with our token ids, log-probs
and weight versions), OpenAI's log-probs shapes, and `usage`."""

from __future__ import annotations

from typing import Any

from rollout.serving.http import tool_choice
from rollout.serving.http.areal_routes import as_token_ids
from rollout.serving.http.backend import Backend
from rollout.serving.http.schemas import CompletionRequest, finish_reason
from rollout.serving.http.scoring import completion_logprobs


def cached_tokens(records: list, n: int) -> int:
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache
    served, once per prompt (its first choice's), as prompt_tokens counts them."""
    return sum(int(r.cached_tokens) for r in records[::n])


def token_usage(prompts: list[list[int]], n: int, generated: list[int]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n, as OpenAI counts
    completion = sum(generated)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}  # fmt: skip


def scores_only(req: Any) -> bool:
    return isinstance(req, CompletionRequest) and req.scores_only()


def choice_body(be: Backend, req: Any, index: int, prompt: list[int], rec: Any, chat: bool) -> dict:
    tokens = list(rec.generated_tokens)
    text = rec.generated_text if rec.generated_text is not None else be.text(tokens)
    ext = {"token_ids": tokens, "token_logprobs": list(rec.generated_log_probs),
           "weight_versions": list(rec.generated_weight_versions), "prompt_token_ids": prompt}  # fmt: skip
    reason = finish_reason(rec.stop_reason)
    if chat:
        lp = (
            chat_logprobs(be, tokens, rec.generated_log_probs, generated_tops(rec, len(tokens)))
            if req.logprobs
            else None
        )
        msg, reason = tool_choice.message(be, req, rec, text, reason)
        return {"index": index, "message": msg, "logprobs": lp, "finish_reason": reason, **ext}
    if req.scores_only():  # nothing generated: the token the prompt's forward sampled is dropped
        text, reason = "", "length"
        ext.update(token_ids=[], token_logprobs=[], weight_versions=[])
    if (req.model_extra or {}).get("skip_special_tokens") is False and be.tokenizer is not None:
        text = be.tokenizer.decode(tokens, skip_special_tokens=False)  # schemas: unstreamed only
    if req.echo:
        text = be.text(prompt) + text
    lp = None
    if req.logprobs is not None:
        gen_tops = [] if req.scores_only() else generated_tops(rec, len(tokens))
        lp = completion_logprobs(be.text, prompt if req.echo else None, rec, gen_tops)
        if req.return_tokens_as_token_ids:  # AReaL's vLLM path
            ptops = [None, *(rec.prompt_top_n_logprobs or [{}] * (len(prompt) - 1))]
            lp = as_token_ids(lp, [*(prompt if req.echo else []), *(tokens if gen_tops else [])],
                              [*(ptops if req.echo else []), *gen_tops])  # fmt: skip
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason, **ext}


def generated_tops(rec: Any, n: int, start: int = 0) -> list[dict]:
    """Top log-probs of generated tokens start..start+n ({} each when none were asked)."""
    return one_per_token(rec.generated_top_n_logprobs[start : start + n], n)


def one_per_token(tops: list[dict], n: int) -> list[dict]:
    """`tops` aligned to the last of `n` tokens: tokens resumed from another engine's
    checkpoint after a failover carry no top-n, and get {}."""
    return [{}] * (n - len(tops)) + list(tops[-n:] if n else [])


def chat_logprobs(be: Backend, tokens: list[int], lps: list[float], tops: list[dict]) -> dict:
    def entry(tid: int, lp: float) -> dict:
        s = be.text([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(k, v) for k, v in top.items()]}
                        for t, lp, top in zip(tokens, lps, tops, strict=True)]}  # fmt: skip
