"""Request intake: what a caller submits becomes a record the engine can serve, or a RequestError
that says why it never can be.

Every check here is per request, so a bad prompt fails that request alone (a FAILED record out
of the next step) and never the batch it would have joined.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from rollout.engine.config import InferenceConfig
from rollout.engine.errors import RequestError
from rollout.engine.logits_processors import RequestLogits
from rollout.engine.routing import check_routing
from rollout.engine.sequence import Sequence
from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams
from rollout.tokenizers import tokenize_with

if TYPE_CHECKING:
    from rollout.engine.engine import DynamicInferenceEngine

Prompt = str | Seq[int] | torch.Tensor


def new_record(
    request_id: int, prompt: Prompt | None, sp: SamplingParams | None, tokenizer: Any,
    block_size: int, enable_prefix_caching: bool,
) -> tuple[DynamicInferenceRequestRecord, RequestError | None]:  # fmt: skip
    """A one-segment record for `prompt` and the RequestError of a prompt that cannot be read
    (the record then holds no tokens; the caller fails it). Raises ValueError for `sp` that is
    not SamplingParams: a caller's bug, not a request's."""
    sp = sp if sp is not None else SamplingParams()
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
    error = None
    try:
        tokens = prompt_tokens(tokenizer, prompt)
    except RequestError as e:
        tokens, error = torch.zeros(0, dtype=torch.int64), e
    req = DynamicInferenceRequest(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        sampling_params=sp,
        prompt_tokens=tokens,
        block_size_tokens=block_size,
        enable_prefix_caching=False,  # the engine hashes incrementally itself
    )
    req.enable_prefix_caching = enable_prefix_caching
    return DynamicInferenceRequestRecord.from_request(req), error


def prompt_tokens(tokenizer: Any, prompt: Prompt | None) -> torch.Tensor:
    """The int64 token ids of a str (tokenized with BOS), token-id list or 1-D int tensor."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("a str prompt needs a tokenizer")
        try:
            ids = tokenize_with(tokenizer, prompt, bos=True)
        except Exception as e:  # e.g. a lone surrogate: this prompt fails, not the batch
            raise RequestError(f"prompt cannot be tokenized: {type(e).__name__}: {e}") from e
        return torch.tensor(ids, dtype=torch.int64)
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise RequestError(
                f"a tensor prompt must be 1-D integer, got {prompt.dtype} {tuple(prompt.shape)}"
            )
        return prompt.detach().to("cpu", torch.int64)
    if isinstance(prompt, Seq) and not isinstance(prompt, (bytes, bytearray)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("a token-id prompt must hold only ints")
        return torch.tensor(list(prompt), dtype=torch.int64)
    raise RequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")


def check_request(
    req: DynamicInferenceRequest, config: InferenceConfig, vocab_size: int, num_blocks: int
) -> None:
    """Raise RequestError unless `req` can run to completion on this engine: valid sampling
    params, a non-empty prompt of in-vocabulary ids, and room for every token it may generate
    (in max_sequence_length and in the whole KV pool)."""
    try:
        req.sampling_params.check()  # params changed after validation never reach a step
    except Exception as e:
        raise RequestError(f"invalid sampling_params: {e}") from e
    tokens = req.prompt_tokens
    if tokens is None or tokens.numel() == 0:
        raise RequestError("empty prompt: nothing to condition on")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise RequestError(f"token id {bad} is out of range for vocab_size {vocab_size}")
    total = req.prompt_length + req.remaining_tokens_to_generate
    if total > config.max_sequence_length:
        raise RequestError(
            f"prompt ({req.prompt_length} tokens) + tokens to generate "
            f"({req.remaining_tokens_to_generate}) = {total} exceeds max_sequence_length "
            f"{config.max_sequence_length}"
        )
    blocks = -(-total // config.block_size)
    if blocks > num_blocks:
        raise RequestError(
            f"request needs {blocks} KV blocks of {config.block_size} tokens, "
            f"the pool has {num_blocks}"
        )


def check_stop_words(tokenizer: Any, sp: SamplingParams) -> None:
    """Stop words match the decoded text, so they need a tokenizer to decode with."""
    if sp.stop_words and tokenizer is None:
        raise RequestError("stop_words need a tokenizer")


def sequence_for(
    engine: DynamicInferenceEngine, record: DynamicInferenceRequestRecord, given: list[int] | None
) -> Sequence:
    """The engine's Sequence for the last segment of `record`, with its seed, logits processors
    and grammar state (both rebuilt over the tokens of a resumed request). RequestError when it
    can never be served here; ValueError for `given` hashes its prompt has no blocks for (a
    caller's bug)."""
    config, req = engine.config, record.requests[-1]
    check_request(req, config, engine.vocab_size, engine.kv.num_blocks)
    check_routing(req, engine.routing)
    check_stop_words(engine.tokenizer, req.sampling_params)
    processors = RequestLogits.for_request(req.sampling_params, engine.tokenizer,
                                           engine.vocab_size, engine._eos)  # fmt: skip
    sp = req.sampling_params
    seed = sp.seed if sp.seed is not None else engine._next_seed()
    if sp.seed is None:  # recorded: a checkpoint, a re-dispatch and a replay keep the stream
        req.sampling_params = sp = sp.replace(seed=seed)
    full = req.prompt_length // config.block_size
    if given is not None and len(given) > full:
        raise ValueError(
            f"precomputed_block_hashes has {len(given)} hashes but the prompt has only "
            f"{full} complete blocks of {config.block_size} tokens"
        )
    if given:
        req.precomputed_block_hashes = list(given)
    seq = Sequence(record, seed, record.requests[0].prompt_length, config.block_size,
                   engine._eos, given, engine._decode)  # fmt: skip
    seq.streamed = seq.num_generated
    if processors is not None:  # counts rebuilt from the tokens of a resumed request
        seq.processors = processors.attach(seq.tokens, seq.first_prompt_len)
    seq.log_probs = [x for r in record.requests for x in r.generated_log_probs]
    if sp.structured_outputs is not None:  # resumed: re-advanced over what it generated
        try:
            seq.grammar = engine.grammars.state(sp.structured_outputs,
                                                seq.tokens[seq.first_prompt_len :])  # fmt: skip
        except ValueError as e:
            raise RequestError(str(e)) from None
    return seq
