"""Replay: regenerate a finished sample from its record and the weights of each version it spans.

A sample's completion was sampled piecewise: every token carries the weight version that sampled
it (`Sample.token_versions`), and its draw depends only on (seed, absolute position) and that
row's logits. In batch-invariant mode (`InferenceConfig(batch_invariant=True)`) a row's logits
are the same bits whatever shares its batch, however its prefix was chunked or cached, and whether
its context was prefilled or decoded. So a token sampled under version v, with every earlier
position's KV computed under v (the `recompute` KV policy, an eviction, or a re-dispatch after an
engine died all re-prefill under the current weights), is reproduced by a fresh engine holding v's
weights that decodes from the same prefix with the same seed.

`replay_sample` regenerates the completion segment by segment (one engine per version) and
reports the first token whose id or log-prob bits differ. `score_trace` is the force-decode mode:
it scores a recorded token trace (any tokens, e.g. edited or from another policy) under given
weights, with the same log-probs a decode would have returned.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rollout.engine.config import InferenceConfig
from rollout.engine.engine import DynamicInferenceEngine
from rollout.engine.logits_processors import processors_of
from rollout.rl.samples import Sample
from rollout.sampling import SamplingParams

Weights = nn.Module | Mapping[str, torch.Tensor]


@dataclasses.dataclass
class Replay:
    """What a replay regenerated, beside what the sample recorded."""

    tokens: list[int]
    log_probs: list[float]
    token_versions: list[int]
    recorded_tokens: list[int]
    recorded_log_probs: list[float]

    @property
    def first_mismatch(self) -> int | None:
        """Index of the first completion token whose id or log-prob bits differ (None: exact)."""
        pairs = zip(self.tokens, self.recorded_tokens, strict=False)
        for i, (a, b) in enumerate(pairs):
            if a != b or not _same_bits(self.log_probs[i], self.recorded_log_probs[i]):
                return i
        if len(self.tokens) != len(self.recorded_tokens):
            return min(len(self.tokens), len(self.recorded_tokens))
        return None

    @property
    def exact(self) -> bool:
        return self.first_mismatch is None


def _same_bits(a: float, b: float) -> bool:
    """fp32 log-probs travel as Python floats: equal values are equal bits (NaN never is)."""
    return a == b


def segments(versions: Sequence[int]) -> list[tuple[int, int, int]]:
    """[(version, start, end)] runs of equal versions over the completion, in order."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(versions):
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], i + 1)
        else:
            out.append((v, i, i + 1))
    return out


def check_replayable(sample: Sample) -> None:
    """Raise ValueError unless every token was sampled over a context whose KV its own version
    computed (the recompute policy): under `keep`, old KV shaped the logits, and a fresh engine
    holding one version cannot reproduce them."""
    if sample.is_episode:
        raise ValueError("replay covers single-turn samples; episodes interleave observations")
    if sample.failed:
        raise ValueError(f"sample {sample.request_id} failed ({sample.error}): nothing to replay")
    if sample.sampling_params is None:
        raise ValueError(f"sample {sample.request_id} carries no sampling_params to replay with")
    sp = sample.sampling_params
    if sp.processes_logits:  # a replayed segment restarts from a prompt: its counts would differ
        raise ValueError(
            f"sample {sample.request_id} was sampled with logits processors "
            f"({', '.join(processors_of(sp))}): replay does not cover them"
        )
    if sp.structured_outputs:  # the grammar state starts at the completion, not a segment
        raise ValueError(f"sample {sample.request_id} was sampled under structured_outputs: "
                         "replay does not cover grammar-constrained samples")  # fmt: skip
    if sp.seed is None and not sp.is_greedy:
        raise ValueError(f"sample {sample.request_id} was sampled without a seed")
    n = len(sample.completion_tokens)
    if len(sample.token_versions) != n or len(sample.logprobs) != n:
        raise ValueError(
            f"sample {sample.request_id}: {n} tokens, {len(sample.token_versions)} versions and "
            f"{len(sample.logprobs)} log-probs (return_log_probs=False?)"
        )
    oldest_kv_so_far = None
    for i, v in enumerate(sample.token_versions):
        if oldest_kv_so_far is not None and oldest_kv_so_far < v:
            raise ValueError(
                f"completion token {i} was sampled under version {v} over KV computed under "
                f"version {oldest_kv_so_far} (kv_policy=keep): replay needs kv_policy=recompute"
            )
        kv = sample.kv_versions[i]
        oldest_kv_so_far = kv if oldest_kv_so_far is None else min(oldest_kv_so_far, kv)


class Replayer:
    """One batch-invariant engine per weight version, built on a copy of `model`.

    `weights` maps each version to a state dict (or a module whose state dict it is); a callable
    is asked for a version when it is first needed, so a trainer can load checkpoints lazily.
    `inference_config` must be the one the sample was generated under (block size, log-prob
    mode); batch invariance is switched on whatever it says."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        weights: Mapping[int, Weights] | Callable[[int], Weights],
        inference_config: InferenceConfig | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.weights = weights
        config = inference_config or InferenceConfig()
        self.config = dataclasses.replace(config, batch_invariant=True)
        self._engines: dict[int, DynamicInferenceEngine] = {}

    def engine(self, version: int) -> DynamicInferenceEngine:
        if version not in self._engines:
            self._engines[version] = self._build(version)
        return self._engines[version]

    def _build(self, version: int) -> DynamicInferenceEngine:
        source = self.weights(version) if callable(self.weights) else self.weights.get(version)
        if source is None:
            raise KeyError(f"no weights for version {version}")
        state = source.state_dict() if isinstance(source, nn.Module) else source
        model = copy.deepcopy(self.model)
        model.load_state_dict(state, strict=True)
        return DynamicInferenceEngine(model, self.tokenizer, self.config)

    def replay(self, sample: Sample) -> Replay:
        """Regenerate `sample`'s completion: each version's run of tokens is decoded by that
        version's engine from the prompt plus the tokens before it, with the same seed."""
        check_replayable(sample)
        sp = sample.sampling_params
        tokens: list[int] = []
        log_probs: list[float] = []
        for version, start, end in segments(sample.token_versions):
            prefix = sample.prompt_tokens + sample.completion_tokens[:start]
            run = sp.replace(
                num_tokens_to_generate=end - start, ignore_eos=True, stop_words=[],
                stop_token_ids=[], return_log_probs=True, return_prompt_log_probs=False,
                top_n_logprobs=0,
            )  # fmt: skip
            (req,) = self.engine(version).generate([prefix], run)
            if req.failed():
                raise RuntimeError(f"replay of version {version} failed: {req.events[-1:]}")
            tokens += list(req.generated_tokens)
            log_probs += list(req.generated_log_probs)
        return Replay(tokens, log_probs, list(sample.token_versions),
                      list(sample.completion_tokens), list(sample.logprobs))  # fmt: skip

    def score(
        self,
        prompt_tokens: Sequence[int],
        completion_tokens: Sequence[int],
        sampling_params: SamplingParams,
        token_versions: Sequence[int] | None = None,
    ) -> list[float]:
        """Force-decode: the log-prob of each recorded completion token under the version given
        for it (all under the lowest known version when None), in `sampling_params`'s log-prob
        mode and temperature. Scored by prefill, which batch invariance makes equal to decode."""
        n = len(completion_tokens)
        if n == 0:
            return []
        versions = (
            list(token_versions) if token_versions is not None else [self._only_version()] * n
        )
        if len(versions) != n:
            raise ValueError(f"{len(versions)} token_versions for {n} completion tokens")
        out: list[float] = []
        for version, start, end in segments(versions):
            context = list(prompt_tokens) + list(completion_tokens[:end])
            run = sampling_params.replace(
                num_tokens_to_generate=1, return_prompt_log_probs=True, return_log_probs=False,
                top_n_logprobs=0, stop_words=[], stop_token_ids=[],
            )  # fmt: skip
            (req,) = self.engine(version).generate([context], run)
            if req.failed() or req.prompt_log_probs is None:
                raise RuntimeError(f"scoring under version {version} failed: {req.events[-1:]}")
            # prompt_log_probs[j] scores context token j + 1
            first = len(prompt_tokens) + start - 1
            out += list(req.prompt_log_probs[first : first + end - start])
        return out

    def _only_version(self) -> int:
        if callable(self.weights):
            raise ValueError("token_versions is required when weights is a callable")
        return min(self.weights)

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()


def replay_sample(
    sample: Sample,
    model: nn.Module,
    tokenizer: Any,
    weights: Mapping[int, Weights] | Callable[[int], Weights],
    inference_config: InferenceConfig | None = None,
) -> Replay:
    """Regenerate one sample (see `Replayer`); `replay.exact` says whether every token and
    log-prob came back bit for bit."""
    replayer = Replayer(model, tokenizer, weights, inference_config)
    try:
        return replayer.replay(sample)
    finally:
        replayer.close()


def score_trace(
    prompt_tokens: Sequence[int],
    completion_tokens: Sequence[int],
    sampling_params: SamplingParams,
    model: nn.Module,
    tokenizer: Any,
    weights: Mapping[int, Weights] | Callable[[int], Weights],
    token_versions: Sequence[int] | None = None,
    inference_config: InferenceConfig | None = None,
) -> list[float]:
    """Force-decode a recorded token trace: the log-prob of each completion token (see
    `Replayer.score`)."""
    replayer = Replayer(model, tokenizer, weights, inference_config)
    try:
        return replayer.score(prompt_tokens, completion_tokens, sampling_params, token_versions)
    finally:
        replayer.close()
