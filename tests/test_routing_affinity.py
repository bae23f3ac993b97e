"""Routing-only affinity keys: GRPO groups whose prompt is shorter than one KV block stay together.

Such prompts have no block hash, so prefix routing alone sees nothing to match and scatters a
group across engines. `affinity_key` names the whole prompt for the router only (never a KV key,
never sent to an engine) and is scored like a full-block match, with the same load spill.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from rollout.hashing import HASH_MODULUS, compute_block_hashes_batched
from rollout.serving.coordinator.routing import PREFIX_POLICIES, Router, affinity_key

BLOCK = 16


def _packed(tokens: list[int]) -> bytes:
    """A prompt as the coordinator sees it: packed int32 little-endian token ids."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def _short_prompt(g: int) -> bytes:
    return _packed([(g * 7 + i) % 250 + 1 for i in range(5)])


def _run_step(
    router: Router,
    rng: random.Random,
    groups: int,
    use_affinity: bool = True,
    churn: float = 0.0,
    interleave: int = 1,
):
    """One GRPO step of 8-sample groups of 5-token prompts. The manager submits a group's samples
    back to back (`interleave=1`); `interleave=k` shuffles k groups' samples together (several
    clients, regenerated samples). `churn`: chance that some work finishes after each route.

    Returns ({group: [engine per sample]}, outstanding tokens per engine after the last submit).
    """
    order: list[int] = []
    for first in range(0, groups, interleave):
        window = [g for g in range(first, min(first + interleave, groups)) for _ in range(8)]
        rng.shuffle(window)
        order += window
    routed: dict[int, list] = {g: [] for g in range(groups)}
    # Cost = prompt + max new tokens, the same for every sample of a group.
    costs = [5 + rng.randint(16, 128) for _ in range(groups)]
    outstanding: list[tuple] = []
    for g in order:
        prompt = _short_prompt(g)
        hashes = compute_block_hashes_batched(np.frombuffer(prompt, "<i4"), BLOCK)
        assert hashes == []  # shorter than one block: no KV hash to route by
        cost = costs[g]
        key, _ = router.route(hashes, cost, affinity_key(prompt) if use_affinity else None)
        routed[g].append(key)
        outstanding.append((key, cost))
        while outstanding and rng.random() < churn:
            router.release(*outstanding.pop(rng.randrange(len(outstanding))))
    loads = {k: router.load(k) for k in router.slots}
    for key, cost in outstanding:  # the step ends: everything finishes
        router.release(key, cost)
    return routed, loads


def _together(routed: dict[int, list]) -> float:
    """Fraction of samples on their group's majority engine."""
    same = sum(max(keys.count(k) for k in set(keys)) for keys in routed.values())
    return same / sum(len(keys) for keys in routed.values())


def _router(policy: str = "longest_prefix", alpha: float = 0.5, engines: int = 4, **kw) -> Router:
    r = Router(policy, alpha=alpha, **kw)
    for k in range(engines):
        r.add_engine(k, k)
    return r


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
def test_short_prompt_groups_stay_on_one_engine_with_balanced_load(policy):
    """4 engines, 4 steps of 32 groups submitted before any completes: groups spread evenly."""
    r, rng = _router(policy), random.Random(0)
    for step in range(4):
        routed, loads = _run_step(r, rng, 32)
        assert _together(routed) >= 0.95, (step, routed)
        assert max(loads.values()) <= 1.35 * min(loads.values()), (step, loads)
        r.reset_hashes()  # the weight update after each step
    # Without the key the same stream scatters (the bug this fixes): the test can tell.
    routed, _ = _run_step(_router(policy), rng, 32, use_affinity=False)
    assert _together(routed) < 0.6, routed


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
def test_short_prompt_groups_stay_together_while_work_completes(policy):
    """Completions between submissions (async rollouts) and groups whose samples interleave do
    not pull a group apart, and every engine still gets its share of groups."""
    r, rng = _router(policy), random.Random(1)
    routed, _ = _run_step(r, rng, 64, churn=0.6, interleave=4)
    assert _together(routed) >= 0.95
    groups_per_engine = [sum(keys[0] == k for keys in routed.values()) for k in range(4)]
    assert min(groups_per_engine) >= 8, groups_per_engine  # 16 each if perfectly even
    routed, _ = _run_step(_router(policy), rng, 64, use_affinity=False, churn=0.6, interleave=4)
    assert _together(routed) < 0.6, routed


def test_affinity_key_is_stable_distinct_and_not_a_kv_hash():
    prompt = _packed([5, 6, 7])
    key = affinity_key(prompt)
    assert key == affinity_key(bytearray(prompt)) and 1 <= key <= HASH_MODULUS
    assert key != affinity_key(_packed([5, 6, 8]))
    assert affinity_key("abc") != affinity_key(b"abc")  # text and token prompts never collide
    assert affinity_key("abc") == affinity_key("abc")
    # Same tokens, a full block: the KV chain hash is a different key.
    assert affinity_key(_packed([1] * BLOCK)) not in compute_block_hashes_batched(
        [1] * BLOCK, BLOCK
    )


def test_affinity_spills_like_a_full_block_match():
    r = _router("first_prefix_block", alpha=0.3, engines=2)
    r.reserve(0, 1000)
    r.reserve(1, 1000)
    key = affinity_key(_short_prompt(1))
    first, match = r.route((), 10, key)
    assert match == 0.0
    assert [r.route((), 10, key) for _ in range(2)] == [(first, 1.0)] * 2
    r.reserve(first, 10_000)  # the group's engine becomes far busier: spill, as with blocks
    other, match = r.route((), 10, key)
    assert other != first and match == 0.0


def test_affinity_only_when_there_is_no_block_hash_and_never_in_the_kv_table():
    r = _router(engines=2)
    key = affinity_key(_short_prompt(3))
    for _ in range(3):
        r.route((), 1, key)
    assert not r.table and list(r.affinity) == [key]
    hashes = compute_block_hashes_batched(list(range(2 * BLOCK)), BLOCK)
    r.route(hashes, 1, affinity_key(_short_prompt(4)))  # block hashes win; the key is ignored
    assert list(r.affinity) == [key] and set(r.table) == set(hashes)
    r.reset_hashes()  # weight update: KV beliefs and group affinities both start over
    assert not r.table and not r.affinity


@pytest.mark.parametrize("policy", ["round_robin", "load_balanced"])
def test_non_prefix_policies_ignore_affinity(policy):
    r = _router(policy, engines=2)
    key = affinity_key(_short_prompt(5))
    assert {r.route((), 1, key)[0] for _ in range(4)} == {0, 1}
    assert not r.affinity


def test_affinity_table_is_bounded_and_forgets_dead_engines():
    r = _router(engines=2, max_hash_entries=4)
    keys = [affinity_key(_short_prompt(g)) for g in range(6)]
    for k in keys:
        r.route((), 1, k)
    assert list(r.affinity) == keys[2:]  # least recently routed dropped first
    owner = next(iter(r.affinity_matches(keys[-1])))
    r.remove_engine(owner)
    assert not r.affinity_matches(keys[-1])
    survivor = next(iter(r.slots))
    assert all(r.route((), 1, keys[-1]) == (survivor, m) for m in (0.0, 1.0))


def test_groups_spread_over_idle_engines():
    """Each group finishes before the next starts (every engine idle): new groups still take
    the engines in turn instead of rank 0 taking all (ties go to the least recently picked)."""
    r = _router()
    first = []
    for g in range(8):
        key = affinity_key(_short_prompt(g))
        keys = [r.route((), 10, key)[0] for _ in range(8)]
        assert len(set(keys)) == 1, keys
        first.append(keys[0])
        r.release(keys[0], 80)
    assert first == [0, 1, 2, 3, 0, 1, 2, 3]
