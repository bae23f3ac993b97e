from __future__ import annotations

import random

import pytest

from rollout.hashing import compute_block_hashes_batched
from rollout.protocol import Headers
from rollout.serving.coordinator.routing import Router
from rollout.serving.coordinator.state import CoordinatorState, InvalidTransition, next_state


def _hashes(prompt_id: int, n_blocks: int = 4, bs: int = 4) -> list[int]:
    return compute_block_hashes_batched([prompt_id * 1000 + i for i in range(n_blocks * bs)], bs)


def test_round_robin_by_rank():
    r = Router("round_robin")
    for key, rank in (("b", 1), ("a", 0), ("c", 2)):
        r.add_engine(key, rank)
    assert [r.route()[0] for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_load_balanced_counts_tokens_not_requests():
    r = Router("load_balanced")
    r.add_engine("a", 0)
    r.add_engine("b", 1)
    assert r.route(cost=1000)[0] == "a"
    # ten small requests all go to b: 10*50 < 1000
    assert [r.route(cost=50)[0] for _ in range(10)] == ["b"] * 10
    assert r.route(cost=10)[0] == "b"  # 510 < 1000
    r.release("a", 1000)
    assert r.route(cost=10)[0] == "a"


def test_snapshot_never_erases_local_reservations():
    r = Router("load_balanced")
    r.add_engine("a", 0)
    r.add_engine("b", 1)
    r.reserve("a", 500)
    r.publish_load("a", 0)  # stale snapshot taken before the work arrived
    assert r.load("a") == 500 and r.route(cost=1)[0] == "b"
    r.publish_load("b", 10_000)  # engine reports more than we know of: trust it
    assert r.load("b") == 10_000 and r.route(cost=1)[0] == "a"


def test_released_work_leaves_the_snapshot_too():
    """An engine that drained since its last heartbeat must not keep looking busy."""
    r = Router("load_balanced")
    r.add_engine("a", 0)
    r.add_engine("b", 1)
    r.route(cost=300)  # a
    r.route(cost=100)  # b
    r.publish_load("a", 320)  # heartbeat: a's 300 plus 20 the router never assigned
    r.release("a", 300)  # the reply came back
    assert r.load("a") == 20 and r.route(cost=1)[0] == "a"
    r.release("a", 1000)
    assert r.load("a") == 0


def test_deterministic_mode_ignores_snapshots():
    r = Router("load_balanced", deterministic=True)
    r.add_engine("a", 0)
    r.add_engine("b", 1)
    r.publish_load("a", 10_000)
    assert r.load("a") == 0


def test_load_balanced_ties_rotate():
    r = Router("load_balanced")
    for k in range(3):
        r.add_engine(k, k)
    picks = [r.route(cost=0)[0] for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("policy", ["first_prefix_block", "longest_prefix"])
def test_grpo_groups_stick_and_load_stays_balanced(policy):
    """32 groups of 8 samples of one prompt, submitted before any completes."""
    r = Router(policy, alpha=0.5)
    for k in range(4):
        r.add_engine(k, k)
    rng = random.Random(0)
    same_engine = 0
    for g in range(32):
        hashes, cost = _hashes(g), rng.randint(100, 400)
        keys = [r.route(hashes, cost)[0] for _ in range(8)]
        same_engine += sum(k == keys[0] for k in keys)
    assert same_engine / (32 * 8) >= 0.95
    loads = [r.load(k) for k in range(4)]
    assert max(loads) <= 1.35 * min(loads), loads


def test_longest_prefix_prefers_deeper_match_and_recency():
    r = Router("longest_prefix", alpha=0.9)
    for k in range(3):
        r.add_engine(k, k)
    h = _hashes(1, n_blocks=4)
    r._record(0, h[:1])
    r._record(1, h[:3])
    m = r.matches(h)
    assert m[0][0] == 0.25 and m[1][0] == 0.75 and 2 not in m
    assert r.route(h, 1)[0] == 1
    # equal match: the more recently assigned engine wins the tie
    r2 = Router("longest_prefix", alpha=1.0)
    r2.add_engine("x", 0)
    r2.add_engine("y", 1)
    r2._clock = 1
    r2._record("x", h)
    r2._clock = 2
    r2._record("y", h)
    assert r2.route(h, 0)[0] == "y"


def test_spill_under_imbalance():
    r = Router("first_prefix_block", alpha=0.3)
    r.add_engine("a", 0)
    r.add_engine("b", 1)
    r.reserve("a", 1000)
    r.reserve("b", 1000)
    h = _hashes(7)
    assert r.route(h, 10)[0] == "a"
    assert r.route(h, 10)[0] == "a"  # affinity while loads are close
    assert r.route(h, 10)[0] == "a"
    r.reserve("a", 10_000)  # a becomes far busier
    key, match = r.route(h, 10)
    assert key == "b" and match == 0.0


def test_hash_table_is_bounded_lru_evictable_and_reset():
    r = Router("longest_prefix", max_hash_entries=8)
    r.add_engine("a", 0)
    r.add_engine("b", 1)
    for g in range(5):
        r.route(_hashes(g, n_blocks=4), 1)
    assert len(r.table) == 8
    assert not r.matches(_hashes(0)) and r.matches(_hashes(4))  # oldest evicted
    owner = next(iter(r.matches(_hashes(4))))
    r.evict(owner, _hashes(4))
    assert not r.matches(_hashes(4))
    r.route(_hashes(3), 1)
    r.reset_hashes()
    assert not r.table
    r.remove_engine("a")
    assert all(r.route(_hashes(9), 1)[0] == "b" for _ in range(3))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: Router("random"), ValueError, "policy must be one of"),
        (lambda: Router("longest_prefix", alpha=1.5), ValueError, "alpha"),
        (lambda: Router().route(), LookupError, "no live engine"),
    ],
    ids=["unknown-policy", "alpha-above-1", "route-with-no-engine"],
)
def test_router_rejects_bad_config(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_state_machine():
    R, P, S, X = (CoordinatorState.RUNNING, CoordinatorState.PAUSED, CoordinatorState.SUSPENDED,
                  CoordinatorState.STOPPING)  # fmt: skip
    assert next_state(R, Headers.PAUSE) is P
    assert next_state(P, Headers.PAUSE) is P
    assert next_state(P, Headers.SUSPEND) is S
    assert next_state(S, Headers.RESUME) is P
    assert next_state(P, Headers.UNPAUSE) is R
    assert next_state(S, Headers.STOP) is X
    for state, sig in ((R, Headers.SUSPEND), (S, Headers.UNPAUSE), (R, Headers.STOP),
                       (X, Headers.UNPAUSE), (X, Headers.SET_WEIGHT_VERSION)):  # fmt: skip
        with pytest.raises(InvalidTransition, match=f"{sig.name} is invalid in state"):
            next_state(state, sig)
