"""SkyRL's weight-sync routes on a real `rollout serve` (no skyrl needed): its `delta` backend's
exact HTTP sequence (copied from skyrl 0.4's DeltaTrainerWeightTransferEngine and
SkyrlWeightSyncClient) carries a request across the update and serves the new weights' own
tokens and log-probs; a delta that fails a check (missing file, checksum, shape, unknown
tensor, version order, another model) is a 400 naming the field with the served version
untouched; the NCCL/IPC and LoRA transfers are refused by name (501). The deltas are written
in SkyRL's format (manifest + zstd XOR payloads + xxh3-128 checksums); tests/clients/
test_skyrl_delta.py has SkyRL's own publisher write them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from http_serve import LONG_STREAM, served_fixture
from reference import tiny_model
from safetensors.torch import load_file, save_file

from rollout.models.loader import save_pretrained

FLAGS = ("--block-size", "4", "--streaming-interval", "1")
PAYLOAD = "delta-rank00000-file000000.safetensors"


served = served_fixture("skyrl", *FLAGS)


def _version(c: httpx.Client) -> int:
    return int(c.get("/get_weight_version").json()["weight_version"])


def _save(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    save_pretrained(model, model.config, folder)
    return load_file(folder / "model.safetensors")


def publish(sync_dir: Path, version: int, old: dict, new: dict) -> Path:
    """SkyRL's DeltaCheckpointPublisher output for `new` on `old` (the previous version)."""
    zstandard, xxhash = pytest.importorskip("zstandard"), pytest.importorskip("xxhash")
    folder = sync_dir / f"delta-{version:08d}"
    folder.mkdir(parents=True)
    records, payloads = [], {}
    for name, tensor in new.items():
        a = old[name].contiguous().reshape(-1).view(torch.uint8).numpy()
        b = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        if (a == b).all():
            continue
        packed = zstandard.ZstdCompressor(level=1).compress((a ^ b).tobytes())
        payloads[name] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
        records.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape), "uncompressed_num_bytes": int(b.nbytes),
                        "compressed_num_bytes": len(packed), "payload_file": PAYLOAD,
                        "payload_key": name, "checksum": xxhash.xxh3_128(b).hexdigest(),
                        "checksum_algorithm": "xxh3-128"})  # fmt: skip
    save_file(payloads, str(folder / PAYLOAD))
    manifest = {"version": version, "base_version": version - 1, "tensors": records,
                "payload_files": [PAYLOAD]}  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _init(c: httpx.Client, base: Path) -> None:
    r = c.post("/init_weight_transfer_engine", json={"init_info": {
        "base_model_path": str(base), "local_checkpoint_dir": str(base.parent / "local"),
        "cloud_download_workers": 4, "checkpoint_load_format": "vllm_multi_thread_safetensors",
        "multi_thread_safetensors_max_workers": 8}})  # fmt: skip
    assert r.status_code == 200, r.text


@torch.no_grad()
def _check_scores(model, prompt: list[int], tokens: list[int], lps: list[float]) -> None:
    logits = model(torch.tensor([prompt + tokens])).float()[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits, -1)
    assert tokens == ref.argmax(-1).tolist()
    got, idx = torch.tensor(lps), torch.arange(len(tokens))
    assert torch.allclose(got, ref[idx, torch.tensor(tokens)], atol=1e-5)


def test_skyrl_delta_sequence_carries_a_request_across_the_update(client, tmp_path):
    base_sd = _save(tiny_model(seed=0), tmp_path / "base")
    new = tiny_model(seed=23)
    update_info = {
        "target_version": 1,
        "version": 1,
        "sync_dir": str(tmp_path / "sync"),
        "uri": str(publish(tmp_path / "sync", 1, base_sd, _save(new, tmp_path / "n"))),
    }
    _init(client, tmp_path / "base")
    before = _version(client)
    body = {"prompt": [5, 6, 7], "max_tokens": LONG_STREAM, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    versions: list[int] = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:  # the request is generating
            if line.startswith("data: {"):
                versions += json.loads(line[6:])["choices"][0]["weight_versions"]
                break
        # DeltaTrainerWeightTransferEngine._apply_receiver_update, call by call
        r = client.post("/fetch_weights", json={"target_version": 1, "sync_dir": update_info[
            "sync_dir"], "uri": update_info["uri"]})  # fmt: skip
        assert r.status_code == 200, r.text
        assert _version(client) == before  # fetched, not served
        assert client.post("/pause?mode=keep&clear_cache=false").status_code == 200
        r = client.post("/reset_prefix_cache", json={"reset_running_requests": True})
        assert r.status_code == 200
        assert client.post("/start_weight_update").status_code == 200
        r = client.post("/update_weights", json={"update_info": update_info})
        assert r.status_code == 200, r.text
        assert _version(client) == before  # served at finish
        r = client.post("/finish_weight_update", json={"weight_version": str(before + 3)})
        assert r.status_code == 200 and r.json()["weight_version"] == before + 3
        assert client.post("/resume").status_code == 200
        for line in lines:
            if line.startswith("data: {"):
                versions += json.loads(line[6:])["choices"][0]["weight_versions"]
    assert len(versions) == LONG_STREAM and versions == sorted(versions)  # nothing lost or repeated
    assert versions[0] == before and versions[-1] == before + 3
    out = client.post("/inference/v1/generate", json={"token_ids": [9, 8, 7], "sampling_params": {
        "max_tokens": 6, "temperature": 0, "logprobs": 0}}).json()["choices"][0]  # fmt: skip
    assert out["weight_versions"] == [before + 3] * 6
    _check_scores(
        new, [9, 8, 7], out["token_ids"], [c["logprob"] for c in out["logprobs"]["content"]]
    )


def _bad(case: str, tmp: Path, base_sd: dict) -> Path:
    """A delta for version 1 that fails `case`."""
    new_sd = dict(base_sd, **{"model.norm.weight": base_sd["model.norm.weight"] * 2})
    folder = publish(tmp / "sync", 1, base_sd, new_sd)
    manifest = json.loads((folder / "manifest.json").read_text())
    rec = manifest["tensors"][0]
    if case == "missing":
        (folder / "manifest.json").unlink()
    elif case == "payload":
        (folder / PAYLOAD).unlink()
    elif case == "checksum":
        rec["checksum"] = "0" * 32
    elif case == "shape":
        rec["shape"] = [rec["shape"][0] // 2, 2]
    elif case == "unknown":
        rec["name"] = "model.layers.99.mlp.up_proj.weight"
    elif case == "order":
        manifest["base_version"] = 3
    (folder / "manifest.json").write_text(json.dumps(manifest)) if case != "missing" else None
    return folder


@pytest.mark.parametrize("case", ["missing", "payload", "checksum", "shape", "unknown", "order"])
def test_a_bad_delta_is_refused_at_fetch_and_nothing_moves(client, tmp_path, case):
    pytest.importorskip("zstandard")
    base_sd = _save(tiny_model(seed=0), tmp_path / "base")
    _bad(case, tmp_path, base_sd)
    _init(client, tmp_path / "base")
    before = _version(client)
    r = client.post(
        "/fetch_weights", json={"target_version": 1, "sync_dir": str(tmp_path / "sync")}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "sync_dir"
    word = {
        "missing": "manifest.json",
        "payload": "missing",
        "checksum": "checksum mismatch",
        "shape": "model.norm.weight",
        "unknown": "layers.99",
        "order": "expected 1 on 0",
    }[case]
    assert word in r.json()["error"]["message"]
    assert client.post("/start_weight_update").status_code == 200
    r = client.post("/update_weights", json={"update_info": {"target_version": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "update_info.target_version"
    assert client.post("/finish_weight_update").status_code == 200
    assert _version(client) == before


def test_another_models_delta_is_refused_at_update(client, tmp_path):
    pytest.importorskip("zstandard")
    other = tiny_model(seed=0, vocab_size=300)  # a consistent chain, not the served model
    base_sd = _save(other, tmp_path / "base")
    new_sd = {k: v + 1 for k, v in base_sd.items()}
    publish(tmp_path / "sync", 1, base_sd, new_sd)
    _init(client, tmp_path / "base")
    before = _version(client)
    r = client.post(
        "/fetch_weights", json={"target_version": 1, "sync_dir": str(tmp_path / "sync")}
    )
    assert r.status_code == 200, r.text
    assert client.post("/start_weight_update").status_code == 200
    r = client.post("/update_weights", json={"update_info": {"target_version": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "update_info"
    assert "unchanged" in r.json()["error"]["message"]
    assert client.post("/finish_weight_update").json()["weight_version"] == before
    assert _version(client) == before


def test_collective_rpc_sleep_wake_and_the_0_3_bracket(client, tmp_path):
    pytest.importorskip("zstandard")
    base_sd = _save(tiny_model(seed=0), tmp_path / "base")
    publish(tmp_path / "sync", 1, base_sd, _save(tiny_model(seed=5), tmp_path / "n"))
    _init(client, tmp_path / "base")
    before = _version(client)

    def rpc(method: str, **kwargs) -> httpx.Response:
        return client.post("/collective_rpc", json={"method": method, "kwargs": kwargs})

    # RemoteInferenceClient: pause(keep) -> sleep_for_weight_sync -> wake weights -> sync ->
    # wake kv_cache -> resume
    assert client.post("/pause", params={"mode": "keep"}).status_code == 200
    assert rpc("skyrl_sleep_for_weight_sync", offload_kv=True).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert rpc("skyrl_wake_for_weight_sync", tags=["weights"]).status_code == 200
    r = client.post(
        "/fetch_weights", json={"target_version": 1, "sync_dir": str(tmp_path / "sync")}
    )
    assert r.status_code == 200, r.text
    assert rpc("skyrl_start_weight_update", is_checkpoint_format=True).status_code == 200
    r = client.post("/update_weights", json={"update_info": {"target_version": 1}})
    assert r.status_code == 200, r.text
    assert rpc("skyrl_finish_weight_update").status_code == 200
    assert rpc("skyrl_wake_for_weight_sync", tags=["kv_cache"]).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.get("/is_paused").json() == {"is_paused": True}  # the caller's pause holds
    assert client.post("/resume").status_code == 200
    assert _version(client) == before + 1
    r = rpc("skyrl_sleep_for_weight_sync", offload_kv="yes")
    assert r.status_code == 400 and r.json()["error"]["param"] == "kwargs.offload_kv"


def test_transfers_without_a_delta_are_refused_by_name(client):
    for method in ("update_weights_nccl", "update_weights_ipc", "skyrl_set_lora_receive_target",
                   "skyrl_discard_in_memory_lora", "some_worker_method"):  # fmt: skip
        r = client.post("/collective_rpc", json={"method": method, "kwargs": {}})
        assert r.status_code == 501 and method in r.json()["error"]["message"], method
    r = client.post("/update_weights", json={"update_info": {
        "names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]],
        "packed": True}})  # fmt: skip
    assert r.status_code == 501 and r.json()["error"]["param"] == "update_info"
    assert "fetch_weights" in r.json()["error"]["message"]  # what to use instead
    r = client.post(
        "/init_weight_transfer_engine",
        json={
            "init_info": {
                "master_address": "127.0.0.1",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 2,
            }
        },
    )
    assert r.status_code == 501 and r.json()["error"]["param"] == "init_info"
    assert client.post("/start_draft_weight_update").status_code == 501
    r = client.post("/fetch_weights", json={"target_version": 1, "uri": "gs://bucket/delta"})
    assert r.status_code == 501 and r.json()["error"]["param"] == "uri"
    r = client.post("/fetch_weights", json={"sync_dir": "/tmp"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "target_version"
    r = client.post("/finish_weight_update", json={"weight_version": "v7"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weight_version"
    r = client.post(
        "/init_weight_transfer_engine",
        json={"init_info": {"base_model_path": "/nonexistent", "checkpoint_load_format": "pt"}},
    )
    assert r.json()["error"]["param"] == "init_info.checkpoint_load_format"
    r = client.post(
        "/init_weight_transfer_engine", json={"init_info": {"base_model_path": "/nonexistent"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "init_info.base_model_path"
