"""Per-request sampling parameters: validated once at construction, msgpack-native on the wire."""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from dataclasses import dataclass, field
from typing import Any

from rollout.structured_outputs import check_spec

_SEED_LIMIT = 2**63
_FLOAT_MAX = sys.float_info.max
INT_LIMIT = 2**31  # top_k, lengths and token ids stay int32: far beyond any vocabulary or context
MAX_TOP_N_LOGPROBS = 1024  # each generated token carries a dict this big
MAX_STOP_WORDS = 64  # every stop word is checked after every generated token
MAX_STOP_WORD_CHARS = 512
MAX_STOP_TOKEN_IDS = 4096
MAX_TOKEN_SET = 1 << 18  # logit_bias / allowed_token_ids entries: any vocabulary's size
MAX_BAD_WORDS = 1024
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt: hashed once per request (rollout.hashing)
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100] (OpenAI's range)
GREEDY_BELOW = 1e-5  # temperature or top_p below this samples greedily (exact where it matters:
# logits / 1e-46 overflow to inf, and top_p=1e-46 rounds to 0 in float32)
LOGPROBS_MODES = ("raw", "processed")
# vLLM's spelling (its --logprobs-mode and our HTTP extension field) -> ours
VLLM_LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}


def logprobs_temperature(mode: str | None, temperature: float) -> float:
    """The temperature the reported log-probs are computed at: log_softmax(logits / this).

    raw (and None, the engine's default): 1, the model's own distribution. processed: the
    request's temperature, the distribution the token was sampled from, as TRL and veRL
    recompute it (top-k/top-p are not applied: the trainer cannot recompute a truncation that
    depends on the nucleus boundary, and TRL/veRL do not). Greedy temperatures (below
    GREEDY_BELOW) count as 1, as in vLLM: the limit T -> 0 is 0 for the argmax and -inf for
    every other token, which scores nothing (lm-eval scores prompts at temperature 0)."""
    if mode == "processed" and temperature >= GREEDY_BELOW:
        return temperature
    return 1.0


def _int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """An integral (not bool) value in [lo, hi); numpy ints are normalised to int."""
    if type(value) is not int:  # exact ints skip the (slow) abstract-class checks
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an int, got {_short(value)}")
        value = int(value)
    if value < lo or (hi is not None and value >= hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise ValueError(f"{name} must be {bound}, got {_short(value)}")
    return value


def _float(name: str, value: Any) -> float:
    if type(value) is not float:  # exact floats skip the (slow) abstract-class checks
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {_short(value)}")
        try:
            value = float(value)
        except (OverflowError, ValueError):
            raise ValueError(f"{name} must be finite, got {_short(value)}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _short(value: Any, limit: int = 200) -> str:
    """repr of `value`, cut to `limit` characters (error messages echo user input)."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_short(value)}")
    return value


def _seq(name: str, value: Any, max_len: int) -> list:
    if type(value) is not list and (
        isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple))
    ):
        raise ValueError(f"{name} must be a list, got {_short(value)}")
    if len(value) > max_len:
        raise ValueError(f"{name} holds at most {max_len} entries, got {len(value)}")
    return list(value)


def _token_ids(name: str, value: Any, max_len: int) -> list[int]:
    ids = _seq(name, value, max_len)
    if not all(type(t) is int and 0 <= t < INT_LIMIT for t in ids):
        try:
            ids = [_int(name, t, 0, INT_LIMIT) for t in ids]
        except ValueError as e:
            raise ValueError(f"{e} in {_short(ids)}") from None
    return ids


def _logit_bias(value: Any) -> dict[int, float] | None:
    """{token id: bias in [-100, 100]}; str keys (JSON's) are read as ids."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_short(value)}")
    if len(value) > MAX_TOKEN_SET:
        raise ValueError(f"logit_bias holds at most {MAX_TOKEN_SET} entries, got {len(value)}")
    out: dict[int, float] = {}
    try:
        for k, v in value.items():
            if isinstance(k, str):
                try:
                    k = int(k)
                except ValueError:
                    raise ValueError(
                        f"logit_bias keys must be token ids, got {_short(k)}"
                    ) from None
            tid = _int("logit_bias", k, 0, INT_LIMIT)
            bias = _float("logit_bias", v)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
            out[tid] = bias
    except ValueError as e:
        raise ValueError(f"{e} in {_short(value)}") from None
    return out


@dataclass
class SamplingParams:
    """How to sample one request. temperature=0 or top_k=1 means greedy; top_k=0 turns top-k off.

    temperature or top_p below GREEDY_BELOW also mean greedy (their limit, computed without
    overflow). Integers are bounded by INT_LIMIT and the list/top-n limits above: anything
    the engine could not honour raises ValueError here, naming the field and the value.

    logprobs_mode: which distribution the returned log-probs (generated, top-n and prompt) are
    of: "raw" (the model's, temperature 1) or "processed" (log_softmax(logits / temperature),
    what was sampled from; `logprobs_temperature`). None leaves it to whoever runs the request:
    an engine computes raw, `rollout serve` its --logprobs-mode, a RolloutManager its config.

    return_routed_experts: record the top-k experts every MoE layer routed each token to (the
    request record's `routed_experts`; routing replay, docs/internals.md "Routing replay").

    vLLM's logits parameters (rollout.engine.logits_processors applies them, in vLLM's order):
    allowed_token_ids (None: all), bad_words (strings the engine tokenizes as vLLM does; their
    last token is banned where the rest was just generated), min_tokens (EOS and
    stop_token_ids banned, stop words not matched, until the request generated that many
    tokens in all, across checkpoints), logit_bias ({token id: added logit}), the
    repetition (prompt and generated tokens), frequency and presence (generated tokens)
    penalties, and min_p (after temperature: drop tokens below min_p x the top probability).
    top_k=-1 is vLLM's spelling of "off" and is stored as 0.
    cache_salt: vLLM's prefix-cache salt (1 to MAX_CACHE_SALT_CHARS characters, or None): mixed
    into the hash of the prompt's first block (rollout.hashing.salted_root), so requests with
    different salts never share prefix-cache blocks; the same salt, or none, do.
    structured_outputs: the grammar the output must follow (rollout.structured_outputs: one of
    json, json_object, regex, choice, grammar, structural_tag), or None; needs the
    `structured` extra (xgrammar) on the engine.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    num_tokens_to_generate: int = 16
    stop_words: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    return_log_probs: bool = False
    top_n_logprobs: int = 0
    return_prompt_log_probs: bool = False
    seed: int | None = None
    ignore_eos: bool = False
    logprobs_mode: str | None = None
    return_routed_experts: bool = False
    include_stop_str_in_output: bool = False  # keep the stop word in the generated text
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if type(self.top_k) is int and self.top_k == -1:  # vLLM's "off"
            self.top_k = 0
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        self.top_k = _int("top_k", self.top_k, 0, INT_LIMIT)
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.num_tokens_to_generate = _int(
            "num_tokens_to_generate", self.num_tokens_to_generate, 1, INT_LIMIT
        )
        words = _seq("stop_words", self.stop_words, MAX_STOP_WORDS)
        for w in words:
            if not isinstance(w, str) or not 0 < len(w) <= MAX_STOP_WORD_CHARS:
                raise ValueError(
                    f"stop_words must hold str of 1 to {MAX_STOP_WORD_CHARS} characters, "
                    f"got {_short(w)} in {_short(words)}"
                )
        self.stop_words = words
        ids = _seq("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if not all(type(t) is int and 0 <= t < INT_LIMIT for t in ids):
            try:
                ids = [_int("stop_token_ids", t, 0, INT_LIMIT) for t in ids]
            except ValueError as e:
                raise ValueError(f"{e} in {_short(ids)}") from None
        self.stop_token_ids = ids
        self.return_log_probs = _bool("return_log_probs", self.return_log_probs)
        self.top_n_logprobs = _int("top_n_logprobs", self.top_n_logprobs, 0, MAX_TOP_N_LOGPROBS + 1)
        self.return_prompt_log_probs = _bool(
            "return_prompt_log_probs", self.return_prompt_log_probs
        )
        if self.seed is not None:
            self.seed = _int("seed", self.seed, 0, _SEED_LIMIT)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.return_routed_experts = _bool("return_routed_experts", self.return_routed_experts)
        if self.logprobs_mode is not None:
            if self.logprobs_mode not in LOGPROBS_MODES:
                raise ValueError(
                    f"logprobs_mode must be one of {LOGPROBS_MODES} or None, "
                    f"got {_short(self.logprobs_mode)}"
                )  # a str subclass (a config enum) is stored as the plain str it equals
            self.logprobs_mode = LOGPROBS_MODES[LOGPROBS_MODES.index(self.logprobs_mode)]
        self.include_stop_str_in_output = _bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self._check_logits_fields()
        self.structured_outputs = check_spec(self.structured_outputs)
        if self.cache_salt is not None and not _salt_ok(self.cache_salt):
            raise ValueError(f"cache_salt must be None or a str of 1 to {MAX_CACHE_SALT_CHARS} "
                             f"characters, got {_short(self.cache_salt)}")  # fmt: skip
        if self.cache_salt is not None:
            self.cache_salt = str(self.cache_salt)  # a str subclass is stored as the plain str

    def _check_logits_fields(self) -> None:
        self.min_tokens = _int("min_tokens", self.min_tokens, 0, INT_LIMIT)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = _token_ids("allowed_token_ids", self.allowed_token_ids, MAX_TOKEN_SET)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token), "
                                 "got []")  # fmt: skip
            self.allowed_token_ids = ids
        words = _seq("bad_words", self.bad_words, MAX_BAD_WORDS)
        for w in words:
            if not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_WORD_CHARS:
                raise ValueError(
                    f"bad_words must hold non-blank str of at most {MAX_STOP_WORD_CHARS} "
                    f"characters, got {_short(w)} in {_short(words)}"
                )
        self.bad_words = words
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def processes_logits(self) -> bool:
        """True when a parameter reshapes the logits before sampling (not min_p, top-k or
        top-p, which truncate the distribution the sampler draws from)."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_p < GREEDY_BELOW or self.top_k == 1

    @property
    def logprobs_temperature(self) -> float:
        """The temperature this request's log-probs are computed at (`logprobs_temperature`)."""
        return logprobs_temperature(self.logprobs_mode, self.temperature)

    def check(self) -> None:
        """Raise ValueError (naming the field) unless every field is still valid: the engine
        calls it on admission, so params changed after construction cannot reach a step."""
        if not _already_valid(self.__dict__):
            SamplingParams(**{f: getattr(self, f) for f in _FIELD_ORDER})

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied (unknown names raise ValueError)."""
        unknown = sorted(set(changes) - _FIELDS)
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s): {unknown}")
        return dataclasses.replace(self, **changes)

    def serialize(self) -> dict[str, Any]:
        """A dict of msgpack-native values (fresh lists, so callers may mutate it)."""
        out = {f: getattr(self, f) for f in _FIELD_ORDER}
        out["stop_words"] = list(self.stop_words)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["bad_words"] = list(self.bad_words)
        if self.logit_bias is not None:
            out["logit_bias"] = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            out["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.structured_outputs is not None:
            out["structured_outputs"] = dict(self.structured_outputs)
        return out

    @classmethod
    def deserialize(cls, obj: dict[str, Any]) -> SamplingParams:
        """Inverse of serialize(); missing keys take defaults, unknown keys raise ValueError."""
        if not isinstance(obj, dict):
            raise ValueError(f"SamplingParams.deserialize expects a dict, got {type(obj).__name__}")
        if obj.keys() == _FIELDS and _already_valid(obj):  # what serialize() emits: skip __init__
            sp = object.__new__(cls)
            sp.__dict__.update(obj)
            sp.stop_words, sp.stop_token_ids = list(obj["stop_words"]), list(obj["stop_token_ids"])
            sp.bad_words = list(obj["bad_words"])
            if sp.logit_bias is not None:
                sp.logit_bias = dict(sp.logit_bias)
            if sp.allowed_token_ids is not None:
                sp.allowed_token_ids = list(sp.allowed_token_ids)
            return sp
        if not obj.keys() <= _FIELDS:
            unknown = sorted(str(k) for k in set(obj) - _FIELDS)
            raise ValueError(f"unknown SamplingParams field(s): {unknown}")
        return cls(**obj)


_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(SamplingParams))
_FIELDS = frozenset(_FIELD_ORDER)
_MODES_OR_NONE = (None, *LOGPROBS_MODES)


def _already_valid(d: dict[str, Any]) -> bool:
    """True when every value already has the exact type and range __post_init__ would produce,
    so validating again would change nothing (anything else takes the general path)."""
    t, p, k, n = d["temperature"], d["top_p"], d["top_k"], d["num_tokens_to_generate"]
    top_n, seed, words, ids = d["top_n_logprobs"], d["seed"], d["stop_words"], d["stop_token_ids"]
    return (
        type(t) is float
        and 0.0 <= t <= _FLOAT_MAX
        and type(p) is float
        and 0.0 < p <= 1.0
        and type(k) is int
        and 0 <= k < INT_LIMIT
        and type(n) is int
        and 1 <= n < INT_LIMIT
        and type(top_n) is int
        and 0 <= top_n <= MAX_TOP_N_LOGPROBS
        and (seed is None or (type(seed) is int and 0 <= seed < _SEED_LIMIT))
        and type(d["return_log_probs"]) is bool
        and type(d["return_prompt_log_probs"]) is bool
        and type(d["ignore_eos"]) is bool
        and type(d["return_routed_experts"]) is bool
        and (d["logprobs_mode"] is None or type(d["logprobs_mode"]) is str)
        and d["logprobs_mode"] in _MODES_OR_NONE
        and type(d["include_stop_str_in_output"]) is bool
        and d["structured_outputs"] is None  # a spec takes the general (checking) path
        and (
            d["cache_salt"] is None or (type(d["cache_salt"]) is str and _salt_ok(d["cache_salt"]))
        )
        and type(words) is list
        and len(words) <= MAX_STOP_WORDS
        and (not words or all(type(w) is str and 0 < len(w) <= MAX_STOP_WORD_CHARS for w in words))
        and type(ids) is list
        and len(ids) <= MAX_STOP_TOKEN_IDS
        and (not ids or all(type(i) is int and 0 <= i < INT_LIMIT for i in ids))
        and _logits_fields_default(d)
    )


def _salt_ok(salt: Any) -> bool:
    return isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS


_LOGITS_DEFAULTS = (("min_tokens", 0), ("logit_bias", None), ("allowed_token_ids", None),
                    ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                    ("repetition_penalty", 1.0), ("min_p", 0.0))  # fmt: skip


def _logits_fields_default(d: dict[str, Any]) -> bool:
    """The fast path holds only requests that leave the logits alone (the common case); any
    other value is validated in full."""
    words = d["bad_words"]
    return (
        type(words) is list
        and not words
        and all(type(d[k]) is type(v) and d[k] == v for k, v in _LOGITS_DEFAULTS)
    )
