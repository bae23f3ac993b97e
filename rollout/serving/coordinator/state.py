"""Coordinator lifecycle state machine: which control signal is legal in which state.

Transitions are applied when a valid signal arrives (so later signals are validated against the
state it leads to) and the client's awaitable resolves only after every live engine acked it.
Repeating a signal whose target state already holds is legal and still broadcast, so its ack
also orders after any earlier one still in flight.
"""

from __future__ import annotations

from enum import Enum

from rollout.protocol import Headers


class CoordinatorState(str, Enum):
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUSPENDED = "SUSPENDED"
    STOPPING = "STOPPING"


class InvalidTransition(ValueError):
    """A control signal that is not legal in the current state (answered with ERROR)."""


R, P, S, X = (
    CoordinatorState.RUNNING,
    CoordinatorState.PAUSED,
    CoordinatorState.SUSPENDED,
    CoordinatorState.STOPPING,
)

# (signal, current state) -> next state; anything missing is invalid.
TRANSITIONS: dict[tuple[Headers, CoordinatorState], CoordinatorState] = {
    (Headers.PAUSE, R): P,
    (Headers.PAUSE, P): P,
    (Headers.PAUSE, S): S,  # already paused (and more)
    (Headers.UNPAUSE, P): R,
    (Headers.UNPAUSE, R): R,
    (Headers.SUSPEND, P): S,
    (Headers.SUSPEND, S): S,
    (Headers.RESUME, S): P,
    (Headers.RESUME, P): P,  # nothing suspended: no-op
    (Headers.RESUME, R): R,
    (Headers.STOP, P): X,
    (Headers.STOP, S): X,
    (Headers.STOP, X): X,
    (Headers.SET_WEIGHT_VERSION, R): R,
    (Headers.SET_WEIGHT_VERSION, P): P,
    (Headers.SET_WEIGHT_VERSION, S): S,
}

_HINT = {
    Headers.UNPAUSE: "RESUME first",
    Headers.SUSPEND: "PAUSE first",
    Headers.STOP: "PAUSE first",
}


def next_state(state: CoordinatorState, signal: Headers) -> CoordinatorState:
    """The state `signal` leads to from `state`; InvalidTransition (with a hint) if illegal."""
    try:
        return TRANSITIONS[(signal, state)]
    except KeyError:
        hint = _HINT.get(signal, "")
        if state is X:
            hint = "the coordinator is stopping"
        raise InvalidTransition(
            f"{signal.name} is invalid in state {state.value}" + (f" ({hint})" if hint else "")
        ) from None
