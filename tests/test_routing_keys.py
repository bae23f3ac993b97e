"""Routing keys: requests that share a client's key (a multi-turn episode) stay on one engine
under every policy while it lives, and follow it when it leaves."""

from __future__ import annotations

import random

import pytest

from rollout.serving.coordinator.routing import POLICIES, Router
from rollout.serving.submissions import check_routing_key


def _router(policy: str, engines: int = 3) -> Router:
    r = Router(policy, alpha=0.5, deterministic=True)
    for rank in range(engines):
        r.add_engine(rank, rank)
    return r


@pytest.mark.parametrize("policy", POLICIES)
def test_a_key_keeps_its_engine_under_every_policy(policy):
    r, rng = _router(policy), random.Random(0)
    owner: dict[str, int] = {}
    for _ in range(600):  # interleaved episodes, keyless traffic and skewed load between them
        key = f"episode-{rng.randrange(40)}"
        hashes = [rng.randrange(1, 2**62) for _ in range(rng.randrange(0, 4))]
        engine, _ = r.route(hashes, rng.randrange(1, 500), None, key)
        assert owner.setdefault(key, engine) == engine
        r.route([rng.randrange(1, 2**62)], rng.randrange(1, 2000))
    assert len(set(owner.values())) == 3  # first placements still follow the policy's spread


def test_a_key_whose_engine_left_follows_its_new_engine():
    r = _router("longest_prefix")
    first, _ = r.route((), 10, None, "ep")
    r.remove_engine(first)
    second, _ = r.route((), 10, None, "ep")
    assert second != first
    assert [r.route((), 10, None, "ep")[0] for _ in range(3)] == [second] * 3


def test_weight_updates_keep_keys_and_the_table_is_bounded():
    r = Router("load_balanced", max_hash_entries=4)
    for rank in range(2):
        r.add_engine(rank, rank)
    first, _ = r.route((), 10, None, "ep")
    r.reset_hashes()
    assert r.route((), 10_000, None, "ep")[0] == first
    for i in range(10):
        r.route((), 1, None, f"other-{i}")
    assert len(r.sessions) == 4 and "ep" not in r.sessions


@pytest.mark.parametrize(
    "bad", ["", "x" * 257, 7, b"ep"], ids=["empty", "too-long", "int", "bytes"]
)
def test_the_client_refuses_a_bad_key(bad):
    with pytest.raises(ValueError, match="routing_key"):
        check_routing_key(bad)
