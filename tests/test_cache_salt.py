"""vLLM's `cache_salt`: the salt starts the prompt's hash chain (rollout.hashing.salted_root), so
requests with different salts never share prefix-cache blocks and requests with the same salt
(or both unsalted) do. Engine level, the coordinator's routing hashes, and a real `rollout serve`
through /v1/completions, /v1/chat/completions and /inference/v1/generate (counted by `usage.prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from http_serve import serve_http
from reference import prompts_of

from rollout.engine.block_manager import NO_PARENT, BlockManager
from rollout.hashing import ROOT_DIGEST, compute_block_hashes_batched, salted_root
from rollout.protocol import pack_tokens
from rollout.sampling import SamplingParams
from rollout.serving.coordinator.routing import affinity_key
from tests.test_engine import GREEDY, engine, reference

BS = 4


def test_salt_changes_every_hash_of_the_chain():
    tokens = list(range(16))
    plain = compute_block_hashes_batched(tokens, BS)
    assert salted_root(None) == ROOT_DIGEST
    a = compute_block_hashes_batched(tokens, BS, salted_root("a"))
    b = compute_block_hashes_batched(tokens, BS, salted_root("b"))
    assert len(plain) == len(a) == len(b) == 4
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert a == compute_block_hashes_batched(tokens, BS, salted_root("a"))


@pytest.mark.parametrize("bad", ["", "x" * 257, 5])
def test_bad_salt_raises_naming_it(bad):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=bad)


def test_salt_round_trips():
    sp = SamplingParams(cache_salt="v3")
    assert SamplingParams.deserialize(sp.serialize()).cache_salt == "v3"


def test_block_manager_verifies_the_salt_of_a_first_block():
    bm = BlockManager(8, BS)
    toks = [1, 2, 3, 4]
    (b,) = bm.allocate(1)
    assert bm.register(b, 77, toks, NO_PARENT, 0, salt="a")
    bm.free([b])
    assert bm.match_prefix([77], toks, 0, salt="b") == []  # same key, other salt: a miss
    assert bm.stats.collisions == 1
    assert bm.match_prefix([77], toks, 0, salt="a") == [b]
    bm.check_invariants()


def _run(eng, prompt, salt):
    before = eng.stats()["tokens_reused"]
    rec = eng.add_request(None, prompt, GREEDY.replace(cache_salt=salt))
    while eng.has_unfinished_requests():
        eng.step()
    return eng.stats()["tokens_reused"] - before, rec.merge()


def test_engine_shares_blocks_only_within_a_salt(model):
    eng = engine(model, block_size=BS)
    (p,) = prompts_of([13], seed=9)  # 3 complete blocks, all reusable (13th token computed)
    want = reference(model, p, 8)
    reused = {}
    for name, salt in [("none", None), ("none again", None), ("a", "a"), ("a again", "a"),
                       ("b", "b"), ("none third", None)]:  # fmt: skip
        reused[name], req = _run(eng, p, salt)
        assert req.generated_tokens == want  # salted or not, the same tokens
        assert req.cached_tokens == reused[name]
    assert reused == {"none": 0, "none again": 12, "a": 0, "a again": 12, "b": 0,
                      "none third": 12}  # fmt: skip
    eng.blocks.check_invariants()


def test_engine_hashes_match_the_coordinators(model):
    """The coordinator forwards hashes it chained from the SUBMIT row's salt: they are the
    engine's own keys, so a forwarded salted hash hits only the same salt's blocks."""
    eng = engine(model, block_size=BS)
    (p,) = prompts_of([13], seed=3)
    tokens = np.frombuffer(pack_tokens(p), dtype="<i4")
    forwarded = compute_block_hashes_batched(tokens, BS, salted_root("s"))
    rec = eng.add_request(None, p, GREEDY.replace(cache_salt="s"),
                          precomputed_block_hashes=forwarded)  # fmt: skip
    while eng.has_unfinished_requests():
        eng.step()
    assert set(forwarded) <= set(eng.blocks.cache)
    assert rec.merge().generated_tokens == reference(model, p, 8)
    assert _run(eng, p, "s")[0] == 12  # the engine's own chain names the same blocks
    assert affinity_key(b"abcd", "s") != affinity_key(b"abcd") != affinity_key(b"abcd", "t")


# ---- a real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = serve_http(tmp_path_factory.mktemp("salt"), "--block-size", str(BS))
    yield s
    s.stop()


def _cached(c: httpx.Client, route: str, prompt: list[int], salt: str | None) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    if route == "/v1/completions":
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    elif route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "x"}], "prompt_token_ids": prompt,
                "max_tokens": 2, "temperature": 0, **extra}  # fmt: skip
    else:
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "temperature": 0},
                **extra}  # fmt: skip
    r = c.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize(
    "route",
    ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"],
)  # /skyrl/v1/generate is the same handler (it asks for routed experts: an MoE model's)
def test_server_shares_blocks_only_within_a_salt(served, route):
    first = {"/v1/completions": 11, "/v1/chat/completions": 12, "/inference/v1/generate": 13}[
        route
    ]  # a fresh prefix per route
    prompt = [first, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    with httpx.Client(base_url=served.url, headers=served.auth, timeout=120) as c:
        got = [_cached(c, route, prompt, salt) for salt in (None, None, "a", "a", "b", "b", None)]
    assert got == [0, 12, 0, 12, 0, 12, 12], got


def test_server_refuses_a_bad_salt_naming_it(served):
    with httpx.Client(base_url=served.url, headers=served.auth, timeout=60) as c:
        for route, body in [("/v1/completions", {"prompt": [1, 2], "cache_salt": ""}),
                            ("/inference/v1/generate", {"token_ids": [1], "cache_salt": 5}),
                            ("/v1/chat/completions", {"messages": [{"role": "user",
                             "content": "x"}], "cache_salt": ["a"]})]:  # fmt: skip
            r = c.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
