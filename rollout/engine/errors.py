"""What goes wrong in an engine, by whose fault: a request that can never be served, a fault in
a step that one request explains, or a device on which every step fails."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that can never be served (too long, bad token ids, empty prompt)."""


class RequestFault(RuntimeError):
    """A fault inside a step that failed one request (the cause is in the message)."""


class EngineBrokenError(RuntimeError):
    """Steps keep failing whatever requests they hold: the process should be restarted."""
