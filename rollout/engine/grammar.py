"""Structured outputs in the engine: one grammar matcher per constrained request (xgrammar).

A request's `SamplingParams.structured_outputs` (rollout.structured_outputs) is compiled once
per distinct spec against the engine's tokenizer (xgrammar caches compiled grammars). Each
constrained sequence holds a `GrammarState`; before a step samples, every constrained row's
matcher fills its row of a bitmask of the tokens that keep the output inside the grammar, and
the sampler sets every other logit to -inf (`TokenMask.apply`). Each sampled token then
advances the matcher.

The state is rebuilt from tokens alone, never shipped: a request re-added to an engine (a
re-dispatch after an engine died, a checkpointed record) gets a fresh matcher advanced over the
tokens it already generated. Eviction, recompute and weight updates keep the sequence and so
its matcher, whose state depends only on those same tokens.

xgrammar is the `structured` extra; without it a constrained request fails by name
(`MissingGrammarLibrary`). Its mask computation runs on the CPU, one row per constrained
request per step (benchmarks/structured_outputs.py measures the cost).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout.structured_outputs import FIELD

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'rollout[structured]'"


class MissingGrammarLibrary(ValueError):
    """structured_outputs was asked for where xgrammar is not installed."""


def xgrammar() -> Any:
    """The xgrammar module, or MissingGrammarLibrary naming the field and the extra."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise MissingGrammarLibrary(
            f"{FIELD} needs the grammar library xgrammar, which is not installed ({INSTALL_HINT})"
        ) from None
    return xgr


def available() -> bool:
    try:
        xgrammar()
        return True
    except MissingGrammarLibrary:
        return False


def build(spec: dict[str, Any]) -> Any:
    """The tokenizer-independent xgrammar Grammar of a normalised spec; ValueError naming
    `structured_outputs.<kind>` when the schema, regex or grammar does not compile."""
    xgr = xgrammar()
    ((kind, value),) = spec.items()
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(value, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_regex("|".join(_regex_escape(c) for c in value))
        if kind == "grammar":
            return _ebnf_or_lark(xgr, value)
        tag = _compact(xgr, json.loads(value))
        return xgr.Grammar.from_structural_tag(xgr.StructuralTag.from_json(tag))
    except MissingGrammarLibrary:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / pydantic errors
        raise ValueError(f"{FIELD}.{kind} does not compile: {_first_line(e)}") from None


def check(spec: dict[str, Any] | None) -> None:
    """ValueError naming the field unless `spec` (normalised) compiles; nothing for None."""
    if spec is not None:
        build(spec)


def _compact(xgr: Any, node: Any) -> Any:
    """A structural tag whose JSON-schema parts allow no free whitespace, as `json` specs: a
    schema part becomes the grammar of its compact JSON (xgrammar's tags would otherwise admit
    whitespace runs, which small or early-training models fill until max_tokens)."""
    if isinstance(node, list):
        return [_compact(xgr, n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        schema = json.dumps(node.get("json_schema"))
        return {"type": "grammar",
                "grammar": str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))}  # fmt: skip
    return {k: _compact(xgr, v) for k, v in node.items()}


def _ebnf_or_lark(xgr: Any, text: str) -> Any:
    try:
        return xgr.Grammar.from_ebnf(text)
    except Exception as ebnf_error:
        try:
            return xgr.Grammar.from_lark(text)
        except Exception:
            raise ebnf_error from None


def _regex_escape(text: str) -> str:
    """`text` as a literal in xgrammar's regex dialect (ECMAScript-like)."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


def _first_line(e: Exception) -> str:
    """xgrammar's message without its "[hh:mm:ss] file.cc:line:" prefix, on one line."""
    text = " ".join(re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+:", "", str(e)).split())
    return (text or type(e).__name__)[:300]


class Grammars:
    """An engine's compiler: the tokenizer's vocabulary as xgrammar sees it, built on first
    use (an engine that never sees a constrained request never imports xgrammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._compiler: Any = None

    def state(self, spec: dict[str, Any], generated: Sequence[int]) -> GrammarState:
        """A matcher for `spec` advanced over the tokens already `generated`; ValueError
        naming the field when it cannot be (no xgrammar, no tokenizer, a bad spec, tokens
        outside the grammar)."""
        compiled = self._compile(json.dumps(spec, sort_keys=True))
        state = GrammarState(xgrammar().GrammarMatcher(compiled))
        for i, token in enumerate(generated):
            if not state.matcher.accept_token(int(token)):
                raise ValueError(f"{FIELD}: generated token {i} ({token}) is outside the "
                                 "grammar; the request cannot resume under it")  # fmt: skip
        return state

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one per engine, for the engine's life)
    def _compile(self, key: str) -> Any:
        return self.compiler().compile_grammar(build(json.loads(key)))

    def warm(self) -> None:
        """Import xgrammar and index the vocabulary now, where installed and a tokenizer is
        given: a process that serves (rollout.serving.factory) pays these seconds at start-up,
        not inside the step of its first constrained request (a stalled step loop misses
        heartbeats)."""
        if self.tokenizer is None or not available():
            return
        try:
            self.compiler()
        except Exception:  # a constrained request meets the error by name; the engine serves
            log.exception("structured outputs unavailable on this engine")

    def compiler(self) -> Any:
        if self._compiler is None:
            xgr = xgrammar()
            if self.tokenizer is None:
                raise ValueError(f"{FIELD} needs the engine's tokenizer (this engine has none)")
            info = tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.eos_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> Any:
    """xgrammar's view of `tokenizer` (rollout's ByteTokenizer or HFTokenizer, a `tokenizers`
    Tokenizer, or a transformers tokenizer), over the model's `vocab_size` ids."""
    from rollout.tokenizers import ByteTokenizer, HFTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        vocab: list[bytes | str] = [bytes([i]) for i in range(256)]
        vocab += [""] * (tokenizer.vocab_size - 256)  # bos/eos/pad: special, never text
        return xgr.TokenizerInfo(vocab[:vocab_size], xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=_ids_below(eos_ids, vocab_size))  # fmt: skip
    backend = tokenizer._tok if isinstance(tokenizer, HFTokenizer) else tokenizer
    if hasattr(backend, "to_str") and hasattr(backend, "get_vocab"):  # tokenizers.Tokenizer
        ids = backend.get_vocab(with_added_tokens=True)
        vocab = [""] * max(max(ids.values()) + 1, 0)
        for text, i in ids.items():
            vocab[i] = text
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        return xgr.TokenizerInfo(vocab[:vocab_size], meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=_ids_below(eos_ids, vocab_size),
                                 add_prefix_space=meta["add_prefix_space"])  # fmt: skip
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=eos_ids)  # fmt: skip


def _ids_below(ids: list[int], vocab_size: int) -> list[int]:
    """A model smaller than its tokenizer never samples the ids past its vocabulary."""
    return [i for i in ids if i < vocab_size]


@dataclass
class GrammarState:
    """One request's position in its grammar."""

    matcher: Any

    def accept(self, token: int) -> None:
        """Advance over the sampled `token`; ValueError when the grammar refuses it (the mask
        allowed it, so only a corrupted state gets here)."""
        if not self.matcher.accept_token(int(token)):
            raise ValueError(f"{FIELD}: the grammar refused sampled token {token}")

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self.matcher.is_terminated()


@dataclass
class TokenMask:
    """The allowed tokens of the constrained rows of one step: `bits` [len(rows), ceil(V/32)]
    int32, bit j of a row set when token j is allowed."""

    rows: list[int]
    bits: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [B, V] with every disallowed token of a masked row at -inf."""
        vocab = logits.shape[-1]
        bits = self.bits.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
        if len(self.rows) == logits.shape[0]:  # every row constrained: one pass, no gather
            return logits.masked_fill(~allowed, float("-inf"))
        rows = torch.tensor(self.rows, device=logits.device)
        masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
        return logits.index_copy(0, rows, masked)

    def row(self, i: int) -> TokenMask | None:
        """The mask of batch row `i` alone (as row 0), or None when it is unconstrained."""
        if i not in self.rows:
            return None
        j = self.rows.index(i)
        return TokenMask([0], self.bits[j : j + 1])


def token_mask(
    states: Sequence[GrammarState | None], vocab_size: int,
    on_fault: Callable[[int, Exception], None],
) -> TokenMask | None:  # fmt: skip
    """The step's mask over the rows whose state is not None (None when no row is
    constrained): each matcher fills its row on the CPU. A row whose matcher raises is
    reported to `on_fault` (its request fails alone) and left unmasked."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    bits = xgrammar().allocate_token_bitmask(len(rows), vocab_size)
    for j, i in enumerate(rows):
        try:
            states[i].matcher.fill_next_token_bitmask(bits, j)
        except Exception as e:
            on_fault(i, e)
    return TokenMask(rows, bits)
