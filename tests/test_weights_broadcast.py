"""Bucketed broadcast between real processes (gloo on 127.0.0.1): identical weights everywhere,
and a corrupted or killed transfer leaves every receiver on the old version."""

from __future__ import annotations

import json
import os
import socket

import torch
import torch.multiprocessing as mp
from torch import nn

BUCKET = 4096  # small: tensors straddle buckets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> nn.Module:
    net = nn.Sequential(nn.Embedding(300, 16), nn.Linear(16, 40), nn.Linear(40, 300))
    net.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    net[1].to(torch.bfloat16)
    return net


def _weights(version: int) -> nn.Module:
    torch.manual_seed(version)
    net = _model()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
        net.steps.fill_(version)
    return net


def _worker(rank: int, port: int, out_dir: str) -> None:
    from rollout.weights.broadcast import (
        WeightReceiver,
        WeightSender,
        WeightSyncError,
        init_weight_sync_group,
    )
    from rollout.weights.state import state_dict_checksum

    torch.set_num_threads(1)
    init_weight_sync_group(rank, 3, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
    log: list[dict] = []
    if rank == 0:
        sender = WeightSender(bucket_bytes=BUCKET)
        for v in (1, 2, 3):
            r = sender.send(_weights(v), v)
            log.append({"v": v, "sum": state_dict_checksum(_weights(v)), "buckets": r.num_buckets})

        def corrupt(i: int, buf: torch.Tensor) -> None:
            if i == 3:
                buf[7] ^= 0xFF

        try:
            sender.send(_weights(4), 4, on_bucket=corrupt)
            log.append({"v": 4, "error": None})
        except WeightSyncError as e:
            log.append({"v": 4, "error": str(e)})
        mixed = {k: v.double() if k == "2.bias" else v for k, v in _weights(5).state_dict().items()}
        try:  # rank 1 would cast float64 -> float32, rank 2 refuses: nobody may apply
            sender.send(mixed, 5)
            log.append({"v": 5, "error": None})
        except WeightSyncError as e:
            log.append({"v": 5, "error": str(e)})
        _dump(out_dir, rank, log)

        def die(i: int, buf: torch.Tensor) -> None:
            if i == 2:
                os._exit(0)  # the trainer dies halfway through version 6

        sender.send(_weights(6), 6, on_bucket=die)
        return
    net = _weights(0)
    recv = WeightReceiver(net, allow_cast=rank == 1)
    while True:
        try:
            r = recv.receive()
            log.append({"v": r.version, "sum": state_dict_checksum(net)})
        except WeightSyncError as e:
            log.append(
                {
                    "error": str(e),
                    "broken": e.transport_broken,
                    "sum": state_dict_checksum(net),
                    "version": recv.version,
                }
            )
            if e.transport_broken:
                break
    _dump(out_dir, rank, log)
    os._exit(0)  # the group is dead; skip teardown


def _dump(out_dir: str, rank: int, log: list[dict]) -> None:
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(log, f)


def test_two_receivers_identical_and_failures_keep_old_version(tmp_path):
    from rollout.weights.state import state_dict_checksum

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    sent = json.loads((tmp_path / "0.json").read_text())
    assert sent[0]["buckets"] > 3
    assert "checksum mismatch" in sent[3]["error"]
    assert "rank 2: manifest rejected" in sent[4]["error"]
    good = {e["v"]: e["sum"] for e in sent[:3]}
    v3 = state_dict_checksum(_weights(3))
    for rank in (1, 2):
        log = json.loads((tmp_path / f"{rank}.json").read_text())
        assert [(e["v"], e["sum"]) for e in log[:3]] == list(good.items())  # bit-identical
        corrupted, refused, killed = log[3], log[4], log[5]
        assert "checksum mismatch" in corrupted["error"] and not corrupted["broken"]
        assert "refused" in refused["error"] and not refused["broken"]
        assert "rank 2" in refused["error"] or rank == 2
        for failure in (corrupted, refused, killed):
            assert (failure["version"], failure["sum"]) == (3, v3)
        assert killed["broken"] and len(log) == 6
