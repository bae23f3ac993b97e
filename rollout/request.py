"""Request records: one request's tokens, log-probs, events, timing and per-token staleness.

A `DynamicInferenceRequest` is one segment of generation. When the engine evicts or suspends a
request it `checkpoint()`s its record: a new segment whose prompt is everything so far. `merge()`
folds the segments back into one request, as if generation had never been interrupted. Records
cross the wire as msgpack (tensors as raw bytes, token/log-prob lists packed), never pickle.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from rollout.codecs import (
    decode_rows,
    decode_top_n,
    deserialize_tensor,
    encode_rows,
    encode_top_n,
    number_list_codec,
    serialize_tensor,
    values_equal,
)
from rollout.events import (
    ERROR_EVENT_TYPES,
    STATUS_BY_NAME,
    DynamicInferenceEvent,
    DynamicInferenceEventType,
    Status,
)
from rollout.hashing import compute_block_hashes_batched, salted_root
from rollout.sampling import SamplingParams

__all__ = [
    "DynamicInferenceEvent",
    "DynamicInferenceEventType",
    "DynamicInferenceRequest",
    "DynamicInferenceRequestRecord",
    "InferenceRequest",
    "Status",
    "compute_block_hashes_batched",
]


_I64, _F64 = number_list_codec("<i8", "q", int), number_list_codec("<f8", "d", float)
_TENSOR = (serialize_tensor, deserialize_tensor)
_CODECS: dict[str, tuple] = {
    "prompt_tokens": _TENSOR,
    "policy_staleness": _TENSOR,
    "kv_cache_staleness": _TENSOR,
    "sampling_params": (SamplingParams.serialize, SamplingParams.deserialize),
    "status": (lambda s: s.name, STATUS_BY_NAME.__getitem__),
    "generated_tokens": _I64,
    "generated_weight_versions": _I64,
    "precomputed_block_hashes": _I64,
    "generated_log_probs": _F64,
    "prompt_log_probs": _F64,
    "tpot": _F64,
    "generated_top_n_logprobs": (encode_top_n, decode_top_n),
    "prompt_top_n_logprobs": (encode_top_n, decode_top_n),
    "routed_experts": (encode_rows, decode_rows),
    "prompt_routed_experts": _TENSOR,
    "events": (
        lambda evs: [e.serialize() for e in evs],
        lambda evs: [] if evs == [] else [DynamicInferenceEvent.deserialize(e) for e in evs],
    ),
}
_DECODERS = tuple((name, codec[1]) for name, codec in _CODECS.items())


# ---------------------------------------------------------------- requests


@dataclass(eq=False)
class InferenceRequest:
    """Fields shared by every request: what was asked, and what came back."""

    request_id: int
    prompt: str | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt_tokens: torch.Tensor | None = None
    arrival_time: float | None = None
    status: Status = Status.WAITING_IN_QUEUE
    generated_text: str | None = None
    generated_tokens: list[int] = field(default_factory=list)
    generated_log_probs: list[float] = field(default_factory=list)
    generated_top_n_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_log_probs: list[float] | None = None
    prompt_top_n_logprobs: list[dict[int, float]] | None = None
    tpot: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Exact-type checks first: this runs for every record decoded off the wire.
        rid = self.request_id
        if type(rid) is not int:
            if isinstance(rid, bool) or not isinstance(rid, (int, np.integer)):
                raise ValueError(f"request_id must be an int, got {rid!r}")
            self.request_id = int(rid)
        if self.sampling_params is None:
            self.sampling_params = SamplingParams()
        elif not isinstance(self.sampling_params, SamplingParams):
            raise ValueError(
                f"sampling_params must be SamplingParams, got {self.sampling_params!r}"
            )
        if type(self.status) is not Status:
            raise ValueError(f"status must be a Status, got {self.status!r}")
        t = self.prompt_tokens
        if t is not None and not (type(t) is torch.Tensor and t.dtype is _INT64 and t.dim() == 1):
            self.prompt_tokens = _as_token_tensor(t)
        if self.arrival_time is None:
            self.arrival_time = time.time()

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(
            values_equal(getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
        )

    __hash__ = None  # mutable

    def serialize(self) -> dict[str, Any]:
        """A dict of msgpack-native values; `deserialize` inverts it exactly."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            enc = _CODECS.get(f.name, (None,))[0]
            out[f.name] = enc(v) if enc is not None and v is not None else v
        return out

    @classmethod
    def deserialize(cls, obj: dict[str, Any]):
        """Inverse of serialize(); bad fields raise ValueError naming the field."""
        if not isinstance(obj, dict):
            raise ValueError(f"{cls.__name__}.deserialize expects a dict, got {type(obj).__name__}")
        names = _field_names(cls)
        if not obj.keys() <= names:
            unknown = sorted(str(k) for k in set(obj) - names)
            raise ValueError(f"unknown {cls.__name__} field(s): {unknown}")
        kwargs = dict(obj)
        name = ""
        try:
            for name, dec in _DECODERS:
                v = kwargs.get(name)
                if v is not None:
                    kwargs[name] = dec(v)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"bad {cls.__name__} field {name!r}: {e}") from None
        if len(kwargs) != len(names):
            return cls(**kwargs)  # defaults to fill in
        # Every field present (what serialize() emits): the generated __init__ would only assign
        # them, so assign directly; __post_init__ still validates and normalises.
        request = object.__new__(cls)
        request.__dict__.update(kwargs)
        request.__post_init__()
        return request

    @property
    def prompt_length(self) -> int:
        return 0 if self.prompt_tokens is None else int(self.prompt_tokens.numel())

    @property
    def total_length(self) -> int:
        """Prompt + generated tokens: the length the staleness tensors cover."""
        return self.prompt_length + len(self.generated_tokens)

    @property
    def remaining_tokens_to_generate(self) -> int:
        return self.sampling_params.num_tokens_to_generate - len(self.generated_tokens)


_INT64, _INT32 = torch.int64, torch.int32
_FIELD_NAMES: dict[type, frozenset[str]] = {}  # per request class, computed once


def _field_names(cls: type) -> frozenset[str]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return names


def _as_token_tensor(tokens: Any) -> torch.Tensor:
    """Any 1-D integer sequence as an int64 tensor (a tensor keeps its device)."""
    if not isinstance(tokens, torch.Tensor):
        arr = np.asarray(tokens)
        if arr.dtype.kind not in "iu" and arr.size:
            raise ValueError(f"prompt_tokens must be integers, got {arr.dtype} from {tokens!r:.80}")
        tokens = torch.from_numpy(arr.astype(np.int64))
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"prompt_tokens must be integers, got dtype {tokens.dtype}")
    if tokens.dim() != 1:
        raise ValueError(f"prompt_tokens must be 1-D, got shape {tuple(tokens.shape)}")
    return tokens.to(torch.int64)


def _as_staleness(name: str, t: Any) -> torch.Tensor:
    """A 1-D integer tensor as int32 (the staleness counters' dtype)."""
    if type(t) is torch.Tensor and t.dtype is _INT32 and t.dim() == 1:
        return t
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t!r}")
    return t.to(_INT32)


def _grow(t: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """A staleness tensor covering n tokens: new positions are zero-filled."""
    if t is None:
        return torch.zeros(n, dtype=torch.int32, device=device)
    if t.numel() > n:
        raise ValueError(f"staleness tensor covers {t.numel()} tokens, request has only {n}")
    if t.numel() < n:
        t = torch.cat([t, t.new_zeros(n - t.numel())])
    return t


@dataclass(eq=False)
class DynamicInferenceRequest(InferenceRequest):
    """One segment of a request inside the dynamic engine.

    `generated_weight_versions[i]` is the weight version that sampled `generated_tokens[i]`.
    `policy_staleness`/`kv_cache_staleness` are int32 per-token counters over prompt + generated:
    how many weight updates the engine applied since the token was sampled / since its KV was
    computed, relative to the engine's weights `staleness_version` (stamped when the record
    leaves the engine; None = never stamped). The trainer-facing staleness is derived from these
    at hand-out (rollout.rl.staleness; definitions in docs/internals.md, "Staleness").

    Routing replay (`sampling_params.return_routed_experts`, MoE models): `routed_experts[i]`
    [moe_layers, k] (uint8, int16 past 256 experts) are the experts that routed the forward
    whose logits sampled `generated_tokens[i]`, i.e. of the token before it;
    `prompt_routed_experts` [first prompt length - 1, moe_layers, k] those of the prompt tokens
    before that, or None when the engine did not compute them (prefix-cache hit).
    """

    generated_weight_versions: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    policy_staleness: torch.Tensor | None = None
    kv_cache_staleness: torch.Tensor | None = None
    block_size_tokens: int | None = None
    enable_prefix_caching: bool = False
    precomputed_block_hashes: list[int] = field(default_factory=list)
    events: list[DynamicInferenceEvent] = field(default_factory=list)
    ttft: float | None = None
    latency: float | None = None
    last_token_time: float | None = None  # carried across checkpoints so tpot stays continuous
    staleness_version: int | None = None  # engine weights the staleness counters are relative to
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    prompt_routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        ct = self.cached_tokens
        if isinstance(ct, bool) or not isinstance(ct, (int, np.integer)) or ct < 0:
            raise ValueError(f"cached_tokens must be an int >= 0, got {ct!r}")
        sv = self.staleness_version
        if sv is not None and (isinstance(sv, bool) or not isinstance(sv, (int, np.integer))):
            raise ValueError(f"staleness_version must be an int or None, got {sv!r}")
        if self.policy_staleness is not None:
            self.policy_staleness = _as_staleness("policy_staleness", self.policy_staleness)
        if self.kv_cache_staleness is not None:
            self.kv_cache_staleness = _as_staleness("kv_cache_staleness", self.kv_cache_staleness)
        bs = self.block_size_tokens
        if bs is not None and (
            isinstance(bs, bool) or not isinstance(bs, (int, np.integer)) or bs < 1
        ):
            raise ValueError(f"block_size_tokens must be an int >= 1, got {bs!r}")
        if self.enable_prefix_caching and not self.precomputed_block_hashes:
            self.compute_block_hashes()

    def compute_block_hashes(self) -> None:
        """Hash every complete prompt block (once per request; [] if not prefix caching)."""
        if (
            self.enable_prefix_caching
            and self.block_size_tokens
            and self.prompt_length >= self.block_size_tokens  # else no complete block: []
        ):
            root = salted_root(self.sampling_params.cache_salt)
            self.precomputed_block_hashes = compute_block_hashes_batched(
                self.prompt_tokens, self.block_size_tokens, root
            )
        else:
            self.precomputed_block_hashes = []

    @property
    def weight_versions(self) -> list[int]:
        """The distinct weight versions that sampled this request's tokens, sorted."""
        return sorted(set(self.generated_weight_versions))

    @property
    def weight_version_span(self) -> tuple[int, int] | None:
        v = self.generated_weight_versions
        return (min(v), max(v)) if v else None

    # -- generation bookkeeping

    def append_token(
        self,
        token: int,
        log_prob: float | None = None,
        top_n: dict[int, float] | None = None,
        weight_version: int | None = None,
        now: float | None = None,
    ) -> None:
        """Record one sampled token; sets ttft on the first token ever, else appends to tpot."""
        now = time.time() if now is None else now
        if self.last_token_time is None:
            self.ttft = now - self.arrival_time
        else:
            self.tpot.append(now - self.last_token_time)
        self.last_token_time = now
        self.generated_tokens.append(int(token))
        if log_prob is not None:
            self.generated_log_probs.append(float(log_prob))
        if top_n is not None:
            self.generated_top_n_logprobs.append({int(k): float(v) for k, v in top_n.items()})
        if weight_version is not None:
            self.generated_weight_versions.append(int(weight_version))

    # -- staleness

    def _staleness_device(self) -> torch.device:
        return self.prompt_tokens.device if self.prompt_tokens is not None else torch.device("cpu")

    # Out of place: the engine creates these tensors inside torch.inference_mode (a step that
    # evicts and checkpoints) and updates them outside it (update_weights), where an in-place
    # write to an inference tensor raises.

    def increment_staleness(self, policy_only: bool = False) -> None:
        """One weight update happened: +1 on every token (untracked ones start at 1)."""
        n, dev = self.total_length, self._staleness_device()
        self.policy_staleness = _grow(self.policy_staleness, n, dev) + 1
        if not policy_only:
            self.kv_cache_staleness = _grow(self.kv_cache_staleness, n, dev) + 1

    def reset_kv_staleness(self, start: int = 0) -> None:
        """KV of positions [start:] was just recomputed under the current weights."""
        n = self.total_length
        if not 0 <= start <= n:
            raise ValueError(f"start must be in [0, {n}], got {start!r}")
        kept = _grow(self.kv_cache_staleness, n, self._staleness_device())[:start]
        self.kv_cache_staleness = torch.cat([kept, kept.new_zeros(n - start)])

    # -- events

    def add_event(self, type: DynamicInferenceEventType, payload: Any = None) -> None:
        self.events.append(DynamicInferenceEvent(type, payload=payload))

    def add_event_add_engine(self) -> None:
        self.add_event(DynamicInferenceEventType.ADD_ENGINE)

    def add_event_add_context(self) -> None:
        self.add_event(DynamicInferenceEventType.ADD_CONTEXT)

    def add_event_generated_token(
        self,
        token: int,
        blocks_total: int | None = None,
        blocks_hashed_total: int | None = None,
        blocks_hashed_active: int | None = None,
        blocks_ref_count: int | None = None,
    ) -> None:
        """Opt-in per-token event; block counts (from the allocator) are included when given."""
        blocks = {
            "blocks_total": blocks_total,
            "blocks_hashed_total": blocks_hashed_total,
            "blocks_hashed_active": blocks_hashed_active,
            "blocks_ref_count": blocks_ref_count,
        }
        payload = {"token_id": int(token)} | {k: int(v) for k, v in blocks.items() if v is not None}
        self.add_event(DynamicInferenceEventType.GENERATED_TOKEN, payload)

    def add_event_pause(self) -> None:
        self.add_event(DynamicInferenceEventType.PAUSE)

    def add_event_evict(self) -> None:
        self.add_event(DynamicInferenceEventType.EVICT)

    def add_event_finish(self) -> None:
        self.add_event(DynamicInferenceEventType.FINISH)

    def add_event_fail(self) -> None:
        self.add_event(DynamicInferenceEventType.FAIL)

    def mark_failed(self, error: BaseException) -> None:
        """FAILED, with the cause as a non-transient error event then a FAIL event: what every
        failure path (engine, worker, coordinator client side, manager) records."""
        self.status = Status.FAILED
        self.add_event_error_nontransient(error)
        self.add_event_fail()

    def _add_error(self, error: BaseException, transient: bool) -> None:
        payload = {"type": type(error).__name__, "message": str(error), "is_transient": transient}
        kind = ERROR_EVENT_TYPES[0] if transient else ERROR_EVENT_TYPES[1]
        self.add_event(kind, payload)

    def add_event_error_transient(self, error: BaseException) -> None:
        self._add_error(error, True)

    def add_event_error_nontransient(self, error: BaseException) -> None:
        self._add_error(error, False)

    def failed(self) -> bool:
        """FAILED status, a FAIL event or a non-transient error (transient errors were retried).

        Deliberately wider than `status == FAILED`: a merged record takes its status from the
        last segment, so a segment that failed before a retry succeeded still marks the whole
        request failed (its tokens are not one clean generation), and an error event recorded
        without a status change (a client-side failure) counts too. docs/internals.md lists the
        cases.
        """
        bad = (DynamicInferenceEventType.FAIL, DynamicInferenceEventType.ERROR_NONTRANSIENT)
        return self.status == Status.FAILED or any(e.type in bad for e in self.events)

    def succeeded(self) -> bool:
        """Exactly `not failed()`: a WAITING or ACTIVE record (not finished yet) "succeeded"
        too; check `status == COMPLETED` for "finished and fine"."""
        return not self.failed()


# ---------------------------------------------------------------- record


def _first_not_none(values: list) -> Any:
    return next((v for v in values if v is not None), None)


@dataclass(eq=False)
class DynamicInferenceRequestRecord:
    """All segments of one request across checkpoints (evictions, recompute-suspends)."""

    requests: list[DynamicInferenceRequest] = field(default_factory=list)
    latency: float | None = None

    @classmethod
    def from_request(cls, request: DynamicInferenceRequest) -> DynamicInferenceRequestRecord:
        return cls(requests=[request])

    def __getitem__(self, idx: int) -> DynamicInferenceRequest:
        return self.requests[idx]

    def __len__(self) -> int:
        return len(self.requests)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DynamicInferenceRequestRecord):
            return NotImplemented
        return self.latency == other.latency and self.requests == other.requests

    __hash__ = None

    @property
    def request_id(self) -> int:
        if not self.requests:
            raise ValueError("empty record has no request_id")
        return self.requests[0].request_id

    def increment_staleness(self, policy_only: bool = False) -> None:
        """Per weight update; policy_only=True for requests holding no KV (evicted, waiting)."""
        self.requests[-1].increment_staleness(policy_only)

    def checkpoint(self) -> DynamicInferenceRequest:
        """Start a new segment that continues from everything generated so far; returns it."""
        old = self.requests[-1]
        if old.prompt_tokens is None:
            raise ValueError(f"request {old.request_id}: cannot checkpoint before tokenization")
        remaining = old.remaining_tokens_to_generate
        if remaining < 1:
            raise ValueError(
                f"request {old.request_id}: nothing left to generate, cannot checkpoint"
            )
        gen = torch.tensor(old.generated_tokens, dtype=torch.int64, device=old.prompt_tokens.device)
        n, dev = old.total_length, old._staleness_device()

        def carry(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else _grow(t, n, dev).clone()

        sp = old.sampling_params.replace(num_tokens_to_generate=remaining)
        if old.prompt_log_probs is not None:  # already have them: do not recompute over the suffix
            sp = sp.replace(return_prompt_log_probs=False)
        new = DynamicInferenceRequest(
            request_id=old.request_id,
            prompt=old.prompt,
            sampling_params=sp,
            prompt_tokens=torch.cat([old.prompt_tokens, gen]),
            arrival_time=old.arrival_time,
            policy_staleness=carry(old.policy_staleness),
            kv_cache_staleness=carry(old.kv_cache_staleness),
            block_size_tokens=old.block_size_tokens,
            enable_prefix_caching=old.enable_prefix_caching,
            last_token_time=old.last_token_time,
            staleness_version=old.staleness_version,
        )
        self.requests.append(new)
        return new

    def merge(self) -> DynamicInferenceRequest:
        """One checkpoint-agnostic request, equal to an uninterrupted run of the same generation.

        Staleness tensors (if any) are zero-padded to cover every prompt + generated token and,
        with `staleness_version`, come from the last segment (the one that left the engine).
        Events keep segment order (each segment's events as recorded, segments in order), never
        re-sorted by timestamp: clocks step back and hosts disagree.
        """
        if not self.requests:
            raise ValueError("cannot merge an empty record")
        segs, first, last = self.requests, self.requests[0], self.requests[-1]

        def cat(name: str) -> list:
            return [x for r in segs for x in getattr(r, name)]

        def staleness(t: torch.Tensor | None) -> torch.Tensor | None:  # zero-padded to total
            n = first.prompt_length + sum(len(r.generated_tokens) for r in segs)
            return None if t is None else _grow(t, n, t.device).clone()

        texts = [r.generated_text for r in segs]
        return DynamicInferenceRequest(
            request_id=first.request_id,
            prompt=first.prompt,
            sampling_params=first.sampling_params.replace(),
            prompt_tokens=None if first.prompt_tokens is None else first.prompt_tokens.clone(),
            arrival_time=first.arrival_time,
            status=last.status,
            generated_text=None if None in texts else "".join(texts),
            generated_tokens=cat("generated_tokens"),
            generated_log_probs=cat("generated_log_probs"),
            generated_top_n_logprobs=[dict(d) for d in cat("generated_top_n_logprobs")],
            prompt_log_probs=self._merged_prompt_log_probs(),
            prompt_top_n_logprobs=first.prompt_top_n_logprobs,
            tpot=cat("tpot"),
            generated_weight_versions=cat("generated_weight_versions"),
            stop_reason=last.stop_reason,
            policy_staleness=staleness(last.policy_staleness),
            kv_cache_staleness=staleness(last.kv_cache_staleness),
            block_size_tokens=first.block_size_tokens,
            enable_prefix_caching=first.enable_prefix_caching,
            precomputed_block_hashes=list(first.precomputed_block_hashes),
            events=cat("events"),
            ttft=_first_not_none([r.ttft for r in segs]),
            latency=self.latency if self.latency is not None else last.latency,
            last_token_time=last.last_token_time,
            staleness_version=last.staleness_version,
            cached_tokens=first.cached_tokens,
            routed_experts=cat("routed_experts"),
            prompt_routed_experts=first.prompt_routed_experts,
        )

    def _merged_prompt_log_probs(self) -> list[float] | None:
        """The first segment's; if it had none, a later one's minus its generated-suffix entries."""
        generated = 0
        for r in self.requests:
            if r.prompt_log_probs is not None:
                lp = r.prompt_log_probs
                return list(lp[: len(lp) - generated])
            generated += len(r.generated_tokens)
        return None

    def serialize(self) -> dict[str, Any]:
        return {"requests": [r.serialize() for r in self.requests], "latency": self.latency}

    @classmethod
    def deserialize(cls, obj: dict[str, Any]) -> DynamicInferenceRequestRecord:
        if not isinstance(obj, dict) or not isinstance(obj.get("requests"), list):
            raise ValueError(f"record must be a dict with a 'requests' list, got {obj!r:.200}")
        unknown = sorted(str(k) for k in set(obj) - {"requests", "latency"})
        if unknown:
            raise ValueError(f"unknown DynamicInferenceRequestRecord field(s): {unknown}")
        reqs = [DynamicInferenceRequest.deserialize(r) for r in obj["requests"]]
        return cls(requests=reqs, latency=obj.get("latency"))

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.serialize(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> DynamicInferenceRequestRecord:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"from_bytes expects bytes, got {type(data).__name__}")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
            raise ValueError(f"record bytes are not valid msgpack: {e}") from None
        return cls.deserialize(obj)
