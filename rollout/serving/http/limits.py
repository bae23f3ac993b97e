"""Admission: how much work the HTTP front end takes on, per request and in flight.

One small request can fan out into a great deal of engine work (600 prompts x n=128 is 76,800
engine requests; a thousand top log-probs per token times n times max_tokens is hundreds of MB
of answer), and without a bound in flight a burst of such requests queues more than the engines
can finish. So every request is measured before anything is submitted:

- per request: choices (prompts x n), top log-probs per token, and tokens (prompt tokens of every
  choice plus its max_tokens; an echoed prompt with log-probs counts each position
  1 + logprobs times, since the answer carries that many entries for it): past a limit the caller gets 400 naming the parameter to lower,
  since retrying the same request can never succeed;
- in flight, over all requests: choices and tokens admitted but not finished: past a limit the
  caller gets 429 with Retry-After, since the same request succeeds once others finish.

The budget is engine work: a request gives each choice's share back as soon as the engines are
done with it (finished or aborted), not when its answer has been written, so a caller that
never reads its stream holds nothing once its choices are generated (the socket itself is bounded
by the write-idle timeout, server.py). And no caller (a client address) may hold more than
`max_caller_share` of the in-flight limits with a second request: one caller cannot take it all.
Not the bearer token: the server has one token, which all callers share, and a token the server
does not check can be varied at will.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from rollout.sampling import SamplingParams
from rollout.serving.http.schemas import APIError, ChatRequest, bad_request

RETRY_AFTER_S = 1  # what a 429 suggests: in-flight work turns over within engine steps


@dataclass(frozen=True)
class Limits:
    """What the front end admits; `rollout serve --http-max-*` flags set them."""

    max_choices: int = 1024  # prompts x n of one request
    max_logprobs: int = 20  # top log-probs per token (vLLM's default max_logprobs)
    max_request_tokens: int = 4_000_000  # prompt tokens x n + choices x max_tokens, one request
    max_inflight_choices: int = 8192  # engine requests admitted and not finished, all callers
    max_inflight_tokens: int = 32_000_000  # their tokens, counted as for max_request_tokens
    max_caller_share: float = 0.5  # of the in-flight limits, one caller holding work already

    def __post_init__(self) -> None:
        if not 0 < self.max_caller_share <= 1:
            raise ValueError(f"max_caller_share must be in (0, 1], got {self.max_caller_share}")
        for name, value in vars(self).items():
            least = 0 if name == "max_logprobs" else 1
            if name != "max_caller_share" and value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        if self.max_choices > self.max_inflight_choices:
            raise ValueError("max_choices must be <= max_inflight_choices (a request that can "
                             "never fit in flight would wait forever)")  # fmt: skip
        if self.max_request_tokens > self.max_inflight_tokens:
            raise ValueError("max_request_tokens must be <= max_inflight_tokens")


def check_logprobs(req: Any, limits: Limits) -> None:
    """400 when a request asks for more top log-probs per token than the server gives."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        param, asked = "top_logprobs", req.top_logprobs or 0
    else:
        param, asked = "logprobs", req.logprobs or 0
    if asked > limits.max_logprobs:
        raise bad_request(f"{param} must be <= {limits.max_logprobs} on this server, got {asked}",
                          param)  # fmt: skip


def prompt_weight(sp: SamplingParams) -> int:
    """What one prompt position of a choice costs: 1, or 1 + top-n when its log-probs are
    echoed (scoring: every position carries its own and the top-n, in the answer and in memory)."""
    return 1 + sp.top_n_logprobs if sp.return_prompt_log_probs else 1


def choice_costs(prompts: list[list[int]], sps: list[SamplingParams]) -> list[int]:
    """The tokens of each choice (prompt-major, as submitted): its prompt (x prompt_weight) and
    up to max_tokens."""
    max_tokens = max(sp.num_tokens_to_generate for sp in sps)
    weight = max(prompt_weight(sp) for sp in sps)
    return [len(p) * weight + max_tokens for p in prompts for _ in sps]


def request_cost(prompts: list[list[int]], sps: list[SamplingParams]) -> tuple[int, int]:
    """(choices, tokens) of a request."""
    costs = choice_costs(prompts, sps)
    return len(costs), sum(costs)


def caller_of(request: Any) -> str:
    """Whose share a request counts against: its client address."""
    return request.client.host if request.client else ""


class Ticket:
    """One admitted request's share of the in-flight budget, given back choice by choice as the
    engines finish them (`release_choice`) or all at once (`release`); both idempotent."""

    def __init__(self, admission: Admission, caller: str, costs: list[int]) -> None:
        self._admission, self.caller, self._costs = admission, caller, costs
        self.choices, self.tokens = len(costs), sum(costs)
        self._held = set(range(len(costs)))

    def release_choice(self, index: int) -> None:
        if index in self._held:
            self._held.remove(index)
            self._admission._give_back(self.caller, 1, self._costs[index])

    def release(self) -> None:
        if self._held:
            tokens = sum(self._costs[i] for i in self._held)
            self._admission._give_back(self.caller, len(self._held), tokens)
            self._held.clear()

    def release_with(self, owner: object) -> None:
        """Release when `owner` (a stream's generator) is collected, in case it never runs."""
        weakref.finalize(owner, self.release)


class Admission:
    """The in-flight budget of one app (single event loop: no locking needed)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.choices = 0
        self.tokens = 0
        self.callers: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # -> [choices, tokens]

    def admit(self, prompts: list[list[int]], sps: list[SamplingParams],
              caller: str = "") -> Ticket:  # fmt: skip
        costs = choice_costs(prompts, sps)
        choices, tokens = len(costs), sum(costs)
        lim = self.limits
        if choices > lim.max_choices:
            raise bad_request(f"prompts x n is {choices}, more than this server's limit of "
                              f"{lim.max_choices} per request: lower n or send fewer prompts",
                              "n")  # fmt: skip
        if tokens > lim.max_request_tokens:
            scored = prompt_weight(sps[0]) > 1
            raise bad_request(f"this request may need {tokens} tokens (prompt tokens x n"
                              f"{' x (1 + logprobs), echoed' if scored else ''} + choices x "
                              f"max_tokens), more than this server's limit of "
                              f"{lim.max_request_tokens}: lower "
                              f"{'logprobs' if scored else 'max_tokens'} or n",
                              "logprobs" if scored else "max_tokens")  # fmt: skip
        if (self.choices + choices > lim.max_inflight_choices
                or self.tokens + tokens > lim.max_inflight_tokens):  # fmt: skip
            raise APIError(429, f"the server is at its limit of work in flight ({self.choices} "
                                f"choices, {self.tokens} tokens): retry later",
                           "rate_limit_error", code="too_many_requests",
                           headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        self._check_share(caller, choices, tokens)
        self.choices += choices
        self.tokens += tokens
        held = self.callers[caller]
        held[0] += choices
        held[1] += tokens
        return Ticket(self, caller, costs)

    def _check_share(self, caller: str, choices: int, tokens: int) -> None:
        """429 when a caller already holding work would pass its share (one holding nothing is
        always admitted within the limits: a request must never be unable to fit)."""
        held = self.callers.get(caller)
        if not held or not held[0]:
            return
        share, lim = self.limits.max_caller_share, self.limits
        if (held[0] + choices > share * lim.max_inflight_choices
                or held[1] + tokens > share * lim.max_inflight_tokens):  # fmt: skip
            raise APIError(429, f"this caller ({caller}) holds {held[0]} choices and {held[1]} "
                                f"tokens in flight, its share of the server's limits is "
                                f"{share:g}: retry once they finish", "rate_limit_error",
                           code="too_many_requests",
                           headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip

    def _give_back(self, caller: str, choices: int, tokens: int) -> None:
        self.choices -= choices
        self.tokens -= tokens
        held = self.callers[caller]
        held[0] -= choices
        held[1] -= tokens
        if not held[0]:
            del self.callers[caller]
