"""Telling a silent peer from our own stall.

A process that did not run (SIGSTOP, a swapped-out host, an event loop blocked by user code)
sees, when it runs again, a long silence from its peer that is its own doing. Each side's timer
knows when it meant to run: when it runs later than that by more than half the peer timeout, it
did not run, and the silence it measured is discounted (the peer gets a full timeout from now to
answer, and a forgotten peer learns it from the next heartbeat and joins again). Used by the
engine worker and the client for the coordinator.
"""

from __future__ import annotations


def stalled(late_s: float, peer_timeout_s: float) -> bool:
    """This process ran `late_s` seconds behind its own timer: more than half of
    `peer_timeout_s` means it was not running, so the silence it saw is its own."""
    return late_s > peer_timeout_s / 2
