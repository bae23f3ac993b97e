"""The manager's sampling policy: which SamplingParams a request really gets (log-probs forced
on in the run's one mode, logits reshaping refused unless allowed, routing replay) and the seed
of each sample and episode turn (distinct, reproducible streams; a known stream even when the
caller gave no seed, so re-dispatch keeps it and `rollout.rl.replay` can rerun it)."""

from __future__ import annotations

import secrets

from rollout.engine.logits_processors import processors_of
from rollout.rl.manager_config import RolloutManagerConfig
from rollout.sampling import SamplingParams


def resolve_sampling_params(
    config: RolloutManagerConfig, sp: SamplingParams | None
) -> SamplingParams:
    """The caller's parameters (default: SamplingParams()) as every request of this run needs them."""
    sp = sp if sp is not None else SamplingParams()
    if not isinstance(sp, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
    mode = config.logprobs_mode
    if sp.logprobs_mode not in (None, mode):  # one mode per run: the loss recomputes one
        raise ValueError(
            f"sampling_params.logprobs_mode={sp.logprobs_mode!r} differs from the manager's "
            f"logprobs_mode={mode!r}; leave it None or configure the manager"
        )
    reshaping = processors_of(sp) + (["structured_outputs"] if sp.structured_outputs else [])
    if reshaping and not config.allow_logits_processors:
        raise ValueError(
            f"sampling_params.{reshaping[0]} reshapes the logits the tokens are "
            "sampled from, which the trainer's log-prob recompute (log_softmax(logits / T)) "
            "does not reproduce; set RolloutManagerConfig.allow_logits_processors=True and "
            "recompute with rollout.engine.logits_processors.process, or leave it unset"
        )
    if config.routing_replay and not sp.return_routed_experts:
        sp = sp.replace(return_routed_experts=True)
    if sp.return_log_probs and sp.logprobs_mode == mode:
        return sp
    return sp.replace(return_log_probs=True, logprobs_mode=mode)


def sample_seeded(sp: SamplingParams, gid: int, index: int, rid: int) -> SamplingParams:
    """Member `index` of group `gid`, submitted as request `rid`: its own stream."""
    if sp.seed is not None:  # distinct, reproducible streams per sample
        salt = gid * 1009 + index * 7919 + rid
        return sp.replace(seed=(sp.seed * 1_000_003 + salt) % 2**31)
    if not sp.is_greedy:  # a known stream: re-dispatch keeps it, `rollout.rl.replay` reruns it
        return sp.replace(seed=secrets.randbelow(2**31))
    return sp


def turn_seeded(sp: SamplingParams, rid: int) -> SamplingParams:
    """An episode's turn submitted as request `rid`: each turn its own reproducible stream."""
    if sp.seed is None:
        return sp
    return sp.replace(seed=(sp.seed * 1_000_003 + rid * 7919) % 2**31)


def check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an int >= 1, got {n!r}")
