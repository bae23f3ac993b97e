"""The errors an InferenceClient future can carry (their own module: the client and its
re-join state both raise them)."""

from __future__ import annotations


class ClientError(RuntimeError):
    """Base of the errors a client future can carry."""


class RequestFailed(ClientError):
    """The coordinator failed the request (no live engine, refused, shut down...)."""


class RequestAborted(ClientError):
    """The request was aborted before any engine produced a record for it."""


class ControlError(ClientError):
    """The coordinator refused a control signal (invalid transition or bad argument)."""


class ClientStopped(ClientError):
    """The client stopped (or lost the coordinator) while this was still pending."""


class ConnectionReset(ClientStopped):
    """The coordinator forgot this client while this was pending and it cannot be replayed: a
    control signal (it may or may not have been applied) or a stream that delivered tokens."""
