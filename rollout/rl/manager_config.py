"""`RolloutManagerConfig`: what the RolloutManager decides (engine sizes live in InferenceConfig),
checked field by field when built."""

from __future__ import annotations

import dataclasses

from rollout.protocol import SUSPEND_MODES
from rollout.sampling import LOGPROBS_MODES

MODES = ("colocated", "async")
STALE_POLICIES = ("drop", "regenerate")


@dataclasses.dataclass
class RolloutManagerConfig:
    """What the manager decides (engine sizes live in InferenceConfig).

    max_inflight_groups bounds groups submitted but not yet handed out (in flight + ready);
    None means 2 x the batch size, so a full batch leaves partial rollouts behind (set it to the
    batch size for strictly synchronous batches).
    """

    mode: str = "colocated"
    max_staleness: int | None = None
    stale_policy: str = "drop"
    suspend_mode: str = "recompute"
    max_inflight_groups: int | None = None
    initial_version: int = 0
    collect_timeout_s: float = 3600.0
    dp: int = 1  # engines: 1 = one in-process engine, > 1 = engine processes (EngineCluster)
    # "tcp://HOST:PORT": attach to a running coordinator and the engines that joined it (any
    # host) instead of starting engines; `dp` is then how many must have joined to start
    coordinator_address: str | None = None
    max_turns: int = 8  # episodes: model turns
    max_episode_tokens: int | None = None  # episodes: all tokens; None = the engine's limit
    env_timeout_s: float = 60.0  # episodes: one Environment.reset/step call
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    max_extra_groups: int | None = None  # dynamic sampling: extra groups per batch; None = batch
    # Behaviour log-probs of every request: processed = log_softmax(logits / T), what was
    # sampled from (TRL/veRL's convention: the IS ratio is exact at T != 1); raw = T 1.
    logprobs_mode: str = "processed"
    # a batch with more failed samples than this fraction raises BatchFailed (1.0: never)
    max_failed_fraction: float = 0.5
    # MoE: record every token's experts for the trainer to replay (SamplingParams
    # .return_routed_experts on every request; docs/internals.md, "Routing replay")
    routing_replay: bool = False
    # Logits processors (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens)
    # change the distribution tokens are drawn from; a trainer's log_softmax(logits / T) does
    # not. Refused unless True: the trainer then recomputes the processed logits itself
    # (rollout.engine.logits_processors.process) or accepts the mismatch.
    allow_logits_processors: bool = False

    def __post_init__(self) -> None:
        for name in ("routing_replay", "allow_logits_processors"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp must be an int >= 1, got {self.dp!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(
                f"stale_policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}"
            )
        if self.suspend_mode not in SUSPEND_MODES:
            raise ValueError(
                f"suspend_mode must be one of {SUSPEND_MODES}, got {self.suspend_mode!r}"
            )
        if self.max_staleness is not None and (
            isinstance(self.max_staleness, bool) or int(self.max_staleness) < 0
        ):
            raise ValueError(f"max_staleness must be None or >= 0, got {self.max_staleness!r}")
        if self.max_inflight_groups is not None and int(self.max_inflight_groups) < 1:
            raise ValueError(f"max_inflight_groups must be >= 1, got {self.max_inflight_groups!r}")
        if self.collect_timeout_s <= 0:
            raise ValueError(f"collect_timeout_s must be > 0, got {self.collect_timeout_s!r}")
        for name in ("max_turns", "max_episode_tokens", "max_extra_groups"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_extra_groups" else 1)):  # fmt: skip
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_turns is None:
            raise ValueError("max_turns must be a positive int, got None")
        if self.env_timeout_s <= 0:
            raise ValueError(f"env_timeout_s must be > 0, got {self.env_timeout_s!r}")
        frac = self.max_failed_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac <= 1:
            raise ValueError(f"max_failed_fraction must be a number in [0, 1], got {frac!r}")
