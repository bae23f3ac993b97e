"""Engine-side state of one in-flight request: its tokens, KV blocks and hash chain.

The record (rollout.request) is what the caller gets back; a `Sequence` is the engine's view
of it. `tokens` is the whole token list (first prompt + everything generated, across
checkpoints) and `num_computed` how many of them have KV in the cache. Prefill, chunked
prefill, decode and re-prefill after an eviction or a weight update are the same operation:
compute `tokens[num_computed:]` (possibly in chunks) and sample after the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from rollout import hashing
from rollout.detokenizer import IncrementalDetokenizer, find_stop
from rollout.engine.logits_processors import RequestLogits
from rollout.hashing import HASH_MODULUS
from rollout.request import DynamicInferenceRequest, DynamicInferenceRequestRecord
from rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from rollout.engine.grammar import GrammarState


class Sequence:
    def __init__(
        self,
        record: DynamicInferenceRequestRecord,
        seed: int,
        first_prompt_len: int,
        block_size: int,
        eos_ids: frozenset[int],
        block_hashes: list[int] | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.record = record
        self.seed = seed
        self.first_prompt_len = first_prompt_len  # stop words only match after it
        self.block_size = block_size
        self.eos_ids = eos_ids
        req = record.requests[-1]
        self.tokens: list[int] = req.prompt_tokens.tolist() + list(req.generated_tokens)
        # stop words match the generated text as it is decoded (also inside one token); the
        # generated text is then cut where the stop word starts (or ends, when it is kept)
        self.stop_words = list(req.sampling_params.stop_words) if decode is not None else []
        self.text: IncrementalDetokenizer | None = None
        if self.stop_words:
            self.text = IncrementalDetokenizer(decode, self.tokens[first_prompt_len:])
        self.text_end: int | None = None  # where the generated text is cut (a stop word)
        self.num_computed = 0
        self.block_table: list[int] = []
        self._digests: list[bytes] = []
        self.cache_salt = req.sampling_params.cache_salt  # its chain starts from the salted root
        # given hashes (the coordinator's) stand for the first blocks; the chain goes on from
        # digests computed only when a later block needs them
        self.hashes: list[int] = list(block_hashes or [])
        self.num_registered = 0  # blocks [0, n) already offered to the prefix cache
        self.cacheable = True  # False once it holds KV from older weights (kv_policy="keep")
        self.kv_version: int | None = None  # weights that computed its KV; None = no KV
        self.streamed = 0  # generated tokens (all segments) already sent as partials
        self.log_probs: list[float] = []  # of every generated token, all segments (streaming)
        self.prompt_lp: list[float] = []  # prompt log-probs accumulated over prefill chunks
        self.prompt_top_n: list[dict[int, float]] = []  # and their top-n, when asked for
        self.processors: RequestLogits | None = None  # its logits processors, if any
        self.grammar: GrammarState | None = None  # structured outputs (rollout.engine.grammar)

    @property
    def request(self) -> DynamicInferenceRequest:
        return self.record.requests[-1]

    @property
    def request_id(self) -> int:
        return self.record.request_id

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.first_prompt_len

    @property
    def needs_history(self) -> bool:
        """Its next sample reads the token sampled just before (penalties, min_tokens)."""
        return self.processors is not None and self.processors.needs_history

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def wants_prompt_log_probs(self) -> bool:
        req = self.request
        return req.sampling_params.return_prompt_log_probs and req.prompt_log_probs is None

    def block_hashes(self, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` complete blocks (extended incrementally)."""
        if num_blocks > len(self.hashes):
            have, bs = len(self._digests), self.block_size
            parent = self._digests[-1] if self._digests else hashing.salted_root(self.cache_salt)
            new = hashing.chained_block_digests(
                self.tokens[have * bs : num_blocks * bs], bs, parent
            )
            self._digests.extend(new)
            known = len(self.hashes) - have  # leading new blocks whose hash was given
            self.hashes.extend(hashing.digest_to_hash(d) for d in new[max(known, 0) :])
        return self.hashes[:num_blocks]

    def drop_kv(self) -> list[int]:
        """Forget the KV (the caller frees the returned blocks); it is recomputed later."""
        blocks, self.block_table = self.block_table, []
        self.num_computed = 0
        self.num_registered = 0
        self.kv_version = None
        self.cacheable = True
        return blocks

    def take_partial(self) -> tuple[int, list[int], list[float], list[int], list[dict], Any]:
        """What was generated since the last partial, as a StepOutput partial `(request_id,
        tokens, log_probs, weight_versions, top_n_logprobs, routed_experts)`; the next partial
        starts after it. routed_experts (routing replay, else None): the tokens' rows [n,
        moe_layers, k], after the first prompt's rows in the first partial when recorded."""
        start, self.streamed = self.streamed, self.num_generated
        n = self.num_generated - start
        versions = self._last_generated("generated_weight_versions", n)
        tops = self._last_generated("generated_top_n_logprobs", n)
        tokens = self.tokens[self.first_prompt_len + start :]
        experts = self._experts(start, n)
        return self.request_id, tokens, self.log_probs[start:], versions, tops, experts

    def _last_generated(self, field: str, n: int) -> list:
        """The last `n` entries of a per-generated-token record field (an eviction checkpoint
        may split them over segments); fewer when the field is not kept (top-n not asked)."""
        out: list = []
        for req in reversed(self.record.requests):
            if len(out) >= n:
                break
            out[:0] = getattr(req, field)[-(n - len(out)) :]
        return out

    def _experts(self, start: int, n: int) -> torch.Tensor | None:
        if not self.request.sampling_params.return_routed_experts:
            return None
        rows = self._last_generated("routed_experts", n)
        prompt = self.record.requests[0].prompt_routed_experts
        if start == 0 and prompt is not None:
            rows = [*prompt.unbind(0), *rows]
        return torch.stack(rows) if rows else None

    def stop_reason(self, token: int) -> str | None:
        """Why generation ends after `token` was appended (None: keep going)."""
        req = self.request
        sp = req.sampling_params
        if self.num_generated < sp.min_tokens:  # as vLLM: only the length stops it before
            if self.text is not None:
                self.text.add(token)
        elif (reason := self._stop_condition(token, sp)) is not None:
            return reason
        if len(req.generated_tokens) >= sp.num_tokens_to_generate:
            return "length"
        return None

    def _stop_condition(self, token: int, sp: SamplingParams) -> str | None:
        if token in sp.stop_token_ids:
            return "stop_token"
        if not sp.ignore_eos and token in self.eos_ids:
            return "eos"
        if self.text is not None and (new := self.text.add(token)):
            hit = find_stop(self.text.text, len(new), self.stop_words)
            if hit is not None:
                start, word = hit
                self.text_end = start + len(word) if sp.include_stop_str_in_output else start
                return "stop_word"
        return None


def check_block_hashes(hashes: Seq[int] | torch.Tensor | None) -> list[int] | None:
    """Validated `precomputed_block_hashes` (a list of ints or a 1-D int tensor) as a list."""
    if hashes is None:
        return None
    if isinstance(hashes, torch.Tensor):
        if hashes.dim() != 1 or hashes.dtype.is_floating_point or hashes.dtype == torch.bool:
            raise ValueError(
                f"precomputed_block_hashes must be a 1-D integer tensor, got "
                f"{hashes.dtype} {tuple(hashes.shape)}"
            )
        hashes = hashes.tolist()
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Seq):
        raise ValueError(
            f"precomputed_block_hashes must be a list of ints, got {type(hashes).__name__}"
        )
    out = []
    for h in hashes:
        if isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= HASH_MODULUS:
            raise ValueError(
                f"precomputed_block_hashes must hold ints in [1, 2**63 - 1], got {h!r}"
            )
        out.append(h)
    return out
