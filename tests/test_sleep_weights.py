"""vLLM's sleep frees the weights on a real `rollout serve`: level 2 discards them (bytes
reported), a request held by pause(keep) survives, and after SkyRL's colocated order (sleep 2,
wake_up weights, folder update, wake_up kv_cache) every token is the new weights' own; a server
woken without an update refuses new requests (409) instead of computing on freed memory."""

from __future__ import annotations

import json

import httpx
import torch
from http_serve import LONG_STREAM, served_fixture
from reference import greedy, tiny_model

from rollout.models.loader import save_pretrained

served = served_fixture("sleep", "--block-size", "4", "--streaming-interval", "1")


def _folder(tmp, seed: int) -> tuple[str, torch.nn.Module]:
    model = tiny_model(seed=seed)
    save_pretrained(model, model.config, tmp / f"w{seed}")
    return str(tmp / f"w{seed}"), model


def _chunks(lines) -> tuple[list[int], list[int]]:
    tokens, versions = [], []
    for line in lines:
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            tokens += choice["token_ids"]
            versions += choice["weight_versions"]
    return tokens, versions


def _first_chunk(lines) -> list[str]:
    """Read a stream up to its first data chunk (the request is generating), and return it."""
    for line in lines:
        if line.startswith("data: {"):
            return [line]
    raise AssertionError("the stream ended before its first chunk")


def _version(c: httpx.Client) -> int:
    return int(c.get("/get_weight_version").json()["weight_version"])


def test_skyrl_colocated_order_frees_the_weights_and_holds_requests(client, tmp_path):
    before = _version(client)
    old = tiny_model(seed=0) if before == 0 else None
    folder, new = _folder(tmp_path, 31)
    prompt = [5, 6, 7, 8]
    body = {"prompt": prompt, "max_tokens": LONG_STREAM, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = _first_chunk(lines)  # generating: its first token arrived
        assert client.post("/pause", params={"mode": "keep"}).status_code == 200
        slept = client.post("/sleep", params={"level": 2})
        assert slept.status_code == 200, slept.text
        out = slept.json()
        assert out["weights"] == "discarded" and out["weights_bytes_freed"] > 0
        assert out["kv_cache_bytes_freed"] > 0
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert client.post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        r2 = client.post("/update_weights", json={"weight_dir": folder})
        assert r2.status_code == 200 and r2.json()["weight_version"] == before + 1, r2.text
        assert client.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert client.post("/resume").status_code == 200  # the caller's pause(keep)
        tokens, versions = _chunks(first + list(lines))
    assert len(tokens) == LONG_STREAM  # held across the sleep: nothing lost or repeated
    n_old = versions.count(before)
    assert 0 < n_old < LONG_STREAM and versions == [before] * n_old + [before + 1] * (
        LONG_STREAM - n_old
    )
    if old is not None:
        assert tokens[:n_old] == greedy(old, prompt, n_old)
    assert tokens[n_old:] == greedy(new, prompt + tokens[:n_old], LONG_STREAM - n_old)
    fresh = client.post("/v1/completions", json={"prompt": [9, 1, 9], "max_tokens": 6,
                                                 "temperature": 0}).json()  # fmt: skip
    assert fresh["choices"][0]["token_ids"] == greedy(new, [9, 1, 9], 6)


def test_woken_without_weights_refuses_then_serves_the_update(client, tmp_path):
    before = _version(client)
    folder, new = _folder(tmp_path, 32)
    assert client.post("/sleep", params={"level": 2}).json()["weights"] == "discarded"
    assert client.post("/wake_up").status_code == 200  # no update yet
    r = client.post("/v1/completions", json={"prompt": [3, 3], "max_tokens": 2})
    assert r.status_code == 409 and r.json()["error"]["code"] == "weights_discarded", r.text
    assert client.post("/update_weights", json={"weight_dir": folder}).status_code == 200
    out = client.post("/v1/completions", json={"prompt": [3, 3, 4], "max_tokens": 5,
                                               "temperature": 0}).json()  # fmt: skip
    assert out["choices"][0]["token_ids"] == greedy(new, [3, 3, 4], 5)
    assert out["choices"][0]["weight_versions"] == [before + 1] * 5


def test_a_held_request_waits_through_a_wake_without_weights(client, tmp_path):
    """Woken (KV and all) and resumed before the update: the held request computes nothing on
    the freed memory; it goes on once the update lands, every later token the new weights'."""
    folder_a, old = _folder(tmp_path, 33)
    folder_b, new = _folder(tmp_path, 34)
    assert client.post("/update_weights", json={"weight_dir": folder_a}).status_code == 200
    v = _version(client)
    prompt = [2, 7, 1, 8]
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = _first_chunk(lines)  # generating: its first token arrived
        assert client.post("/pause", params={"mode": "keep"}).status_code == 200
        assert client.post("/sleep", params={"level": 2}).json()["weights"] == "discarded"
        assert client.post("/wake_up").status_code == 200
        assert client.post("/resume").status_code == 200  # awake, unpaused, still no weights
        assert (
            client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 409
        )
        assert client.post("/update_weights", json={"weight_dir": folder_b}).status_code == 200
        tokens, versions = _chunks(first + list(lines))
    n_old = versions.count(v)
    assert len(tokens) == 20 and versions == [v] * n_old + [v + 1] * (20 - n_old)
    assert tokens[:n_old] == greedy(old, prompt, n_old)
    assert tokens[n_old:] == greedy(new, prompt + tokens[:n_old], 20 - n_old)


def test_level_one_on_cpu_moves_no_weights(client):
    out = client.post("/sleep", params={"level": 1, "tags": "weights"}).json()
    assert out["weights"].startswith("in host memory") and out["weights_bytes_freed"] == 0
    assert out["kv_cache_bytes_freed"] == 0  # tags=weights: the KV pool stays
    assert client.post("/wake_up").status_code == 200
    r = client.post("/v1/completions", json={"prompt": [3, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text
