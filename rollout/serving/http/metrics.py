"""Prometheus metrics of the HTTP front end, in a registry of its own (so several apps in one
process, as in tests, never collide in prometheus_client's global registry).

Request counts and latencies are recorded as requests finish, labelled by route template (the
app's own routes, every other path as "other"): a label per raw path would let any caller,
unauthenticated ones included, grow the label set without bound. The coordinator's state, weight
version and per-engine load are read from its stats at scrape time, so they are never stale.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from starlette.routing import Match
from starlette.types import Scope

STATES = ("RUNNING", "PAUSED", "SUSPENDED", "STOPPING")
ENGINE_FIELDS = ("weight_version", "assigned", "outstanding_tokens", "capacity")
OTHER_ROUTE = "other"


def route_label(routes: list, scope: Scope) -> str:
    """The template of the route `scope` matches (wrong method included), else "other"."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return getattr(route, "path", OTHER_ROUTE)
    return OTHER_ROUTE


class HTTPMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("rollout_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)  # fmt: skip
        self.latency = Histogram("rollout_http_request_latency_seconds",
                                 "HTTP request latency (streams: until the response starts)",
                                 ["route"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("rollout_http_prompt_tokens", "prompt tokens", registry=r)
        self.generated_tokens = Counter("rollout_http_generated_tokens", "generated tokens",
                                        registry=r)  # fmt: skip
        self.disconnects = Counter("rollout_http_client_disconnects",
                                   "requests aborted because the caller went away", registry=r)  # fmt: skip
        self.up = Gauge("rollout_coordinator_up", "1 when the coordinator answered stats",
                        registry=r)  # fmt: skip
        self.state = Gauge("rollout_coordinator_state", "1 for the coordinator's current state",
                           ["state"], registry=r)  # fmt: skip
        self.weight_version = Gauge("rollout_weight_version", "the coordinator's weight version",
                                    registry=r)  # fmt: skip
        self.engines = Gauge("rollout_engines", "engines registered with the coordinator",
                             registry=r)  # fmt: skip
        self.pending = Gauge("rollout_pending_requests", "requests the coordinator holds",
                             registry=r)  # fmt: skip
        self.engine = Gauge("rollout_engine", "per-engine figures from the coordinator",
                            ["rank", "field"], registry=r)  # fmt: skip
        self.counters = Gauge("rollout_coordinator_counter", "the coordinator's counters",
                              ["name"], registry=r)  # fmt: skip

    def request_done(self, route: str, status: int, seconds: float) -> None:
        """Count a finished request; `route` must come from `route_label` (a bounded set)."""
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)

    def render(self, stats: dict | None) -> bytes:
        self.up.set(0 if stats is None else 1)
        if stats is not None:
            for s in STATES:
                self.state.labels(s).set(1 if stats["state"] == s else 0)
            self.weight_version.set(stats["weight_version"])
            self.engines.set(len(stats["engines"]))
            self.pending.set(stats["pending_requests"])
            self.engine.clear()
            for rank, e in stats["engines"].items():
                for f in ENGINE_FIELDS:
                    self.engine.labels(str(rank), f).set(e[f])
            for name, value in stats["counters"].items():
                self.counters.labels(name).set(value)
        return generate_latest(self.registry)
