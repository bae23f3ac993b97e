"""vLLM's RL control routes, SGLang's native API and AReaL's /areal_* routes on a real
`rollout serve`, driven with the request sequences prime-rl, SkyRL, slime and AReaL send
(copied route by route from their sources: prime_rl/utils/client.py, skyrl's
remote_inference_client.py, slime/backends/sglang_utils/sglang_engine.py,
areal/engine/vllm_remote.py): versions move, requests carry across updates, tokens and
log-probs are the served weights' own (<= 1e-5 against a plain forward), and a bad folder
leaves the served version as it was."""

from __future__ import annotations

import datetime
import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from http_serve import LONG_STREAM, serve_http, served_fixture
from reference import tiny_model

from rollout.models.loader import save_pretrained

FLAGS = ("--block-size", "4", "--streaming-interval", "1")


served = served_fixture("frameworks", *FLAGS)


def _folder(tmp: Path, seed: int, name: str, **overrides) -> tuple[Path, torch.nn.Module]:
    model = tiny_model(seed=seed, **overrides)
    save_pretrained(model, model.config, tmp / name)
    return tmp / name, model


def _version(c: httpx.Client) -> int:
    return int(c.get("/get_weight_version").json()["weight_version"])


@torch.no_grad()
def _check_scores(model: torch.nn.Module, prompt: list[int], tokens: list[int],
                  lps: list[float]) -> None:  # fmt: skip
    """Greedy tokens and their raw log-probs are `model`'s own (a plain forward)."""
    seq = torch.tensor([prompt + tokens])
    logits = model(seq).float()[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits, -1)
    assert tokens == ref.argmax(-1).tolist()
    got = torch.tensor(lps)
    assert torch.allclose(got, ref[torch.arange(len(tokens)), torch.tensor(tokens)], atol=1e-5)


# ---- prime-rl: pause(keep) -> update_weights {weight_dir} -> resume ------------------------


def test_prime_rl_sequence_carries_a_request_across_a_folder_update(served, client, tmp_path):
    before = _version(client)
    folder, model = _folder(tmp_path, seed=11, name="step_1")
    body = {"prompt": [5, 6, 7], "max_tokens": LONG_STREAM, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_salt": f"v{before}"}  # fmt: skip
    versions: list[int] = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:  # the request is generating: its first tokens arrived
            if line.startswith("data: {"):
                versions += json.loads(line[6:])["choices"][0]["weight_versions"]
                break
        # prime_rl.utils.client.update_weights, route by route
        assert (
            client.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code
            == 200
        )
        assert client.get("/is_paused").json() == {"is_paused": True}
        r2 = client.post("/update_weights", json={"weight_dir": folder.as_posix()})
        assert r2.status_code == 200, r2.text
        assert r2.json()["weight_version"] == before + 1
        assert client.post("/resume").status_code == 200
        for line in lines:
            if line.startswith("data: {"):
                versions += json.loads(line[6:])["choices"][0]["weight_versions"]
    assert len(versions) == LONG_STREAM  # nothing lost or repeated
    assert versions[0] == before and versions[-1] == before + 1
    assert versions.count(before) > 0 and versions.count(before + 1) > 0
    assert versions == sorted(versions)
    # after the update: the folder's weights answer
    out = client.post("/inference/v1/generate", headers={"X-Session-ID": "episode-1"},
                      json={"token_ids": [9, 8, 7], "cache_salt": f"v{before + 1}",
                            "sampling_params": {"max_tokens": 6, "temperature": 0,
                                                "logprobs": 0}}).json()  # fmt: skip
    choice = out["choices"][0]
    assert choice["weight_versions"] == [before + 1] * 6
    assert choice["policy_staleness"] == [0] * 6
    lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    _check_scores(model, [9, 8, 7], choice["token_ids"], lps)


@pytest.mark.parametrize("case", ["missing", "shapes", "other_model", "empty"])
def test_a_failing_folder_update_leaves_the_served_version(served, client, tmp_path, case):
    before = _version(client)
    if case == "missing":
        folder = tmp_path / "absent"
    elif case == "shapes":
        folder, _ = _folder(tmp_path, 3, "w")
        from safetensors.torch import load_file, save_file

        sd = load_file(folder / "model.safetensors")
        sd["model.norm.weight"] = torch.ones(3)
        save_file(sd, folder / "model.safetensors")
    elif case == "other_model":
        folder, _ = _folder(tmp_path, 3, "w", vocab_size=300)
    else:
        folder = tmp_path / "empty"
        folder.mkdir()
    r = client.post("/update_weights", json={"weight_dir": str(folder)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "weight_dir"
    assert _version(client) == before
    r = client.post("/update_weights_from_disk", json={"model_path": str(folder)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    r = client.post("/areal_update_weights", json={"model_path": str(folder)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    assert _version(client) == before


@pytest.mark.heavy  # a second server, an engine killed and restarted (~1 min here)
def test_an_engine_restarted_after_a_folder_update_serves_the_folder(tmp_path):
    """The supervisor restarts a killed engine; it is held for weights until the folder's
    version reaches it (the pusher's snapshot), so it never serves the checkpoint's."""
    import os
    import signal

    s = serve_http(tmp_path, "--restart-backoff", "0.1")
    try:
        with httpx.Client(base_url=s.url, headers=s.auth, timeout=120) as c:
            folder, model = _folder(tmp_path, 71, "w")
            assert c.post("/update_weights", json={"weight_dir": str(folder)}).status_code == 200
            os.kill(int(s.out.wait_for(r"engine 0 pid (\d+)")[1]), signal.SIGKILL)
            s.out.wait_for(r"engine 0 restarted pid")
            out = c.post("/inference/v1/generate", json={"token_ids": [4, 2, 9], "sampling_params":
                         {"max_tokens": 5, "temperature": 0, "logprobs": 0}}).json()  # fmt: skip
    finally:
        s.stop()
    choice = out["choices"][0]
    assert choice["weight_versions"] == [1] * 5
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    _check_scores(model, [4, 2, 9], choice["token_ids"], lps)


# ---- SkyRL's control calls -----------------------------------------------------------------


def test_skyrl_control_calls(served, client, tmp_path):
    # RemoteInferenceClient: world size, sleep/wake (level 2, tags), reset cache, pause modes
    assert client.get("/get_world_size").json() == {"world_size": 1}
    r = client.post("/sleep", params={"level": 2})
    assert r.status_code == 200 and r.json()["kv_cache_bytes_freed"] > 0
    assert r.json()["weights"] == "discarded" and r.json()["weights_bytes_freed"] > 0
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert client.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV is not back yet
    folder, _ = _folder(tmp_path, 13, "colocated")  # the colocated order: weights, then the KV
    assert client.post("/update_weights", json={"weight_dir": str(folder)}).status_code == 200
    assert client.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    r = client.post("/reset_prefix_cache", json={"reset_running_requests": True})
    assert r.status_code == 200
    for mode in ("abort", "wait", "keep"):
        assert client.post("/pause", params={"mode": mode}).status_code == 200
        assert client.post("/resume").status_code == 200
    assert client.get("/is_paused").json() == {"is_paused": False}
    gen = client.post("/inference/v1/generate", json={
        "token_ids": [1, 2, 3], "model": "tiny", "cache_salt": "3", "sampling_params": {
            "max_tokens": 4, "temperature": 1.0, "min_tokens": 0, "skip_special_tokens": True,
            "min_p": 0, "top_k": -1, "ignore_eos": True},  # sampled: no early EOS
        }, headers={"X-Session-ID": "s"})  # fmt: skip
    assert gen.status_code == 200, gen.text
    assert len(gen.json()["choices"][0]["weight_versions"]) == 4


def test_pause_abort_answers_the_request_in_flight(served, client):
    body = {"prompt": [4, 4, 4], "max_tokens": 200, "ignore_eos": True, "stream": True}
    reasons = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        assert client.post("/pause", params={"mode": "abort"}).status_code == 200
        for line in lines:
            if line.startswith("data: {"):
                reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
    assert reasons[-1] == "abort"
    assert client.post("/resume").status_code == 200


def test_refused_by_name_and_guarded(served, client):
    r = client.post("/collective_rpc", json={"method": "update_weights_nccl"})
    assert r.status_code == 501 and "update_weights_nccl" in r.json()["error"]["message"]
    r = client.post("/update_weights", json={"update_info": {"names": []}})
    assert r.status_code == 501 and r.json()["error"]["param"] == "update_info"
    assert client.post("/update_weights_from_tensor", json={}).status_code == 501
    assert client.post("/pause", params={"mode": "later"}).json()["error"]["param"] == "mode"
    assert client.post("/sleep", params={"level": 3}).json()["error"]["param"] == "level"
    assert client.post("/wake_up", params={"tags": "gpu"}).json()["error"]["param"] == "tags"
    r = client.post(
        "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens"
    r = client.post("/generate", json={"input_ids": [1], "sampling_params": {"regex": "a+"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex"
    r = client.post("/inference/v1/generate", json={"token_ids": [1], "cache_salt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    routes = ["/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache",
              "/update_weights", "/collective_rpc", "/generate", "/flush_cache",
              "/update_weights_from_disk", "/init_weights_update_group",
              "/pause_generation", "/continue_generation", "/release_memory_occupation",
              "/areal_update_weights", "/areal_pause_generation"]  # fmt: skip
    for path in routes:
        assert httpx.post(served.url + path, json={}).status_code == 401, path
    for path in ("/is_paused", "/is_sleeping", "/get_world_size", "/get_server_info"):
        assert httpx.get(served.url + path).status_code == 401, path


# ---- slime: SGLang's native API ------------------------------------------------------------


def _init_custom_process_group(url: str, world_size: int, rank: int, group_name: str):
    """slime's / SGLang's init_custom_process_group (the trainer's side of the group)."""
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=60)
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], "gloo", PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None,
                                      timeout=timeout)  # fmt: skip
    return pg


def test_slime_sequence(served, client, tmp_path):
    # start-up: health_generate, flush_cache until 200, get_server_info compared field by field
    assert client.get("/health_generate").status_code == 200
    assert client.get("/flush_cache").status_code == 200
    info = client.get("/get_server_info").json()
    assert {info[k] for k in ("tp_size", "pp_size", "ep_size", "nnodes")} == {1}
    assert info["dp_size"] == 1 and info["node_rank"] == 0
    before = _version(client)
    # rollout: /generate in SGLang's shape
    r = client.post("/generate", json={"input_ids": [3, 1, 4, 1], "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                           "top_p": 1.0, "top_k": -1,
                                                           "skip_special_tokens": False,
                                                           "no_stop_trim": True}})  # fmt: skip
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert [x[1] for x in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert out["meta_info"]["output_token_weight_versions"] == [before] * 5
    # weights over the trainer's group (distributed path), in two buckets
    _, model = _folder(tmp_path, 21, "dist")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(sd)
    port = _free_port()
    group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
             "world_size": 2, "group_name": "slime", "backend": "gloo"}  # fmt: skip
    pg_box: dict = {}
    t = threading.Thread(
        target=lambda: pg_box.update(
            pg=_init_custom_process_group(f"tcp://127.0.0.1:{port}", 2, 0, "slime")
        )
    )
    t.start()
    assert client.post("/init_weights_update_group", json=group).status_code == 200
    t.join(60)
    pg = pg_box["pg"]
    assert client.post("/pause_generation", json={}).status_code == 200
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    answers = []
    for i, bucket in enumerate(halves):
        body = {"names": bucket, "dtypes": [str(sd[n].dtype).replace("torch.", "") for n in bucket],
                "shapes": [list(sd[n].shape) for n in bucket], "group_name": "slime",
                "flush_cache": i == 1, "weight_version": str(before + 1)}  # fmt: skip

        def send(bucket=bucket) -> None:
            for n in bucket:
                torch.distributed.broadcast(sd[n], group_src=0, group=pg)

        sender = threading.Thread(target=send)
        sender.start()
        answers.append(client.post("/update_weights_from_distributed", json=body).json())
        sender.join(60)
    assert [a["applied"] for a in answers] == [False, True], answers
    assert client.post("/continue_generation", json={}).status_code == 200
    assert _version(client) == before + 1
    assert client.post("/destroy_weights_update_group", json={"group_name": "slime"}).json()[
        "success"
    ]
    r = client.post("/generate", json={"input_ids": [3, 1, 4, 1], "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 5,
                                                           "temperature": 0}}).json()  # fmt: skip
    lps = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
    _check_scores(model, [3, 1, 4, 1], r["output_ids"], lps)
    assert r["meta_info"]["weight_version"] == str(before + 1)
    # disk path, memory release and resume
    folder2, _ = _folder(tmp_path, 22, "disk")
    r = client.post("/update_weights_from_disk", json={"model_path": str(folder2)})
    assert r.status_code == 200 and r.json()["weight_version"] == str(before + 2)
    r = client.post("/release_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["weights"] == "discarded", r.text
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    folder3, _ = _folder(tmp_path, 23, "colocated")  # slime's colocated order: weights, then KV
    r = client.post("/update_weights_from_disk", json={"model_path": str(folder3)})
    assert r.status_code == 200 and r.json()["weight_version"] == str(before + 3)
    assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    r = client.post("/generate", json={"text": "ab", "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 3,
                                                           "temperature": 0}}).json()  # fmt: skip
    assert r["meta_info"]["output_token_weight_versions"] == [before + 3] * 3


# ---- AReaL: /v1/completions with token ids, /areal_* ---------------------------------------


def test_areal_sequence(served, client, tmp_path):
    before = _version(client)
    # areal/engine/vllm_remote.py build_generation_request
    body = {"prompt": [7, 7, 1], "top_p": 1.0, "top_k": 100000000, "max_tokens": 5,
            "temperature": 0, "stop_token_ids": [258], "ignore_eos": False,
            "skip_special_tokens": False, "return_tokens_as_token_ids": True, "logprobs": 0,
            "use_beam_search": False, "stream": False}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = [int(t.split(":")[1]) for t in lp["tokens"]]
    assert ids == r.json()["choices"][0]["token_ids"]
    assert client.post("/areal_pause_generation").status_code == 200
    folder, model = _folder(tmp_path, 31, "areal")
    r = client.post("/areal_update_weights", json={"model_path": str(folder)})
    assert r.status_code == 200 and r.json()["weight_version"] == before + 1
    assert client.post("/areal_continue_generation").status_code == 200
    r = client.post("/v1/completions", json=body).json()["choices"][0]
    ids = [int(t.split(":")[1]) for t in r["logprobs"]["tokens"]]
    _check_scores(model, [7, 7, 1], ids, r["logprobs"]["token_logprobs"])
    assert r["weight_versions"] == [before + 1] * len(ids)


def test_areal_xccl_sequence(served, client):
    """AReaL's distributed update, payloads as its VLLMBackend builds them (master_port as a
    string, ParamSpec dtypes and shapes), the trainer's side built like its
    init_custom_process_group; a bad bucket is refused and leaves the version."""
    before = _version(client)
    model = tiny_model(seed=61)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    port = _free_port()
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(
            pg=_init_custom_process_group(f"tcp://127.0.0.1:{port}", 2, 0, "areal")
        )
    )
    t.start()
    r = client.post("/areal_init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1,
        "world_size": 2, "backend": "gloo", "group_name": "areal"})  # fmt: skip
    assert r.status_code == 200, r.text
    t.join(60)
    assert client.post("/areal_pause_generation", json={}).status_code == 200
    names = sorted(sd)
    meta = {"names": names, "dtypes": [str(sd[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(sd[n].shape) for n in names], "group_name": "areal"}  # fmt: skip
    assert client.post("/areal_set_update_weight_meta", json=meta).status_code == 200
    sender = threading.Thread(
        target=lambda: [
            torch.distributed.broadcast(sd[n], group_src=0, group=box["pg"]) for n in names
        ]
    )
    sender.start()
    r = client.post("/areal_update_weights_xccl", json={})
    sender.join(60)
    assert r.status_code == 200 and r.json() == {"success": True, "applied": True,
                                                 "weight_version": before + 1}  # fmt: skip
    assert client.post("/areal_continue_generation", json={}).status_code == 200
    # a mis-shaped tensor: received, refused, version unchanged
    bad = {**meta, "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[3]]}
    assert client.post("/areal_set_update_weight_meta", json=bad).status_code == 200
    sender = threading.Thread(
        target=lambda: torch.distributed.broadcast(torch.ones(3), group_src=0, group=box["pg"])
    )
    sender.start()
    r = client.post("/areal_update_weights_xccl", json={})
    sender.join(60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "names"
    assert _version(client) == before + 1
    r = client.post("/areal_init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2,
        "backend": "nccl", "group_name": "g2"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "master_port"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
