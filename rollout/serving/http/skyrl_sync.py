"""SkyRL's weight sync on `rollout serve`: its `delta` backend (skyrl 0.4, the one that needs no
NCCL or CUDA) translated onto `control.Control`, and its `/collective_rpc` methods.

SkyRL's trainer (`DeltaTrainerWeightTransferEngine`) publishes each step as a delta against the
previous one (rollout.weights.delta) and drives every server, in this order:

    /init_weight_transfer_engine {"init_info": {"base_model_path", ...}}   once
    /fetch_weights {"target_version", "sync_dir" | "uri"}   while generation runs
    /pause?mode=keep   [/reset_prefix_cache]   /start_weight_update
    /update_weights {"update_info": {"target_version", ...}}   /finish_weight_update   /resume

Here fetch replays the deltas from the chain's last applied version onto a host copy of the
checkpoint (starting from `base_model_path`, or the served model's folder), verifying every
checksum, and stages the result; nothing reaches the engines. The update checks the staged
weights against the served model as a folder update is checked (400 naming the field, served
version untouched); finish pushes them through the trainer path as the next version (or
`weight_version`), all-or-nothing. The host copy is one full checkpoint in this process.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import torch

from rollout.serving.http.schemas import APIError, bad_request, int_at_least, not_supported
from rollout.weights.delta import apply_delta, delta_dir, read_manifest
from rollout.weights.folder_update import checked_state_dict, read_folder

LOAD_FORMATS = ("vllm_fastsafetensors", "vllm_multi_thread_safetensors")  # SkyRL's
DELTA_INIT = {"base_model_path", "local_checkpoint_dir", "cloud_download_workers",
              "checkpoint_load_format", "multi_thread_safetensors_max_workers"}  # fmt: skip
DELTA_UPDATE = {"target_version", "version", "sync_dir", "uri"}
INSTEAD = ("use SkyRL's delta backend (/fetch_weights, then /update_weights "
           "{\"update_info\": {\"target_version\"}}) or /update_weights {\"weight_dir\"}")  # fmt: skip
RPC_KWARGS = {"skyrl_sleep_for_weight_sync": {"offload_kv"},
              "skyrl_wake_for_weight_sync": {"tags"},
              "skyrl_start_weight_update": {"is_checkpoint_format"},
              "skyrl_finish_weight_update": set()}  # fmt: skip
REFUSED_RPC = {
    "update_weights_nccl": "NCCL transfers need a CUDA process group; " + INSTEAD,
    "update_weights_ipc": "CUDA IPC handles need a colocated GPU; " + INSTEAD,
    "skyrl_set_lora_receive_target": "LoRA adapters are not served; sync merged weights",
    "skyrl_discard_in_memory_lora": "LoRA adapters are not served; sync merged weights",
}


def _local(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a path", name)
    if value.startswith(("gs://", "s3://")):
        raise not_supported(name, "object-store URIs: publish to a filesystem the server reads")
    return value


class DeltaSync:
    """The delta chain of one server: the checkpoint at `version` (the last one pushed), what
    fetch staged, and the start/update/finish bracket."""

    def __init__(self, ctl: Any) -> None:
        self.ctl = ctl
        self.state: dict[str, torch.Tensor] | None = None  # the checkpoint at `version`
        self.version = 0  # SkyRL's publisher version
        self.staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self.open = False  # between start and finish
        self.pending = False  # an update was accepted: finish pushes it
        self.lock = asyncio.Lock()

    async def init(self, info: Any) -> None:
        if not isinstance(info, dict):
            raise bad_request("init_info must be an object", "init_info")
        if "base_model_path" not in info:
            raise not_supported("init_info", "NCCL/IPC weight-transfer engines; " + INSTEAD)
        if unknown := sorted(set(info) - DELTA_INIT):
            raise bad_request(f"init_info.{unknown[0]} is not supported", f"init_info.{unknown[0]}")
        fmt = info.get("checkpoint_load_format", LOAD_FORMATS[1])
        if fmt not in LOAD_FORMATS:
            raise bad_request(f"checkpoint_load_format must be one of {list(LOAD_FORMATS)}",
                              "init_info.checkpoint_load_format")  # fmt: skip
        for key in ("cloud_download_workers", "multi_thread_safetensors_max_workers"):
            int_at_least(info.get(key, 1), f"init_info.{key}", 1)
        _local(info.get("local_checkpoint_dir"), "init_info.local_checkpoint_dir")
        base = _local(info["base_model_path"], "init_info.base_model_path")
        async with self.lock:
            self.state = await self._read_base(base, "init_info.base_model_path")
            self.version, self.staged, self.pending = 0, None, False

    async def _read_base(self, path: str, param: str) -> dict[str, torch.Tensor]:
        try:
            return await asyncio.to_thread(read_folder, Path(path))
        except (OSError, ValueError) as e:
            raise bad_request(f"{param}: {e}", param) from None

    async def fetch(self, body: dict) -> dict:
        if unknown := sorted(set(body) - {"target_version", "sync_dir", "uri"}):
            raise bad_request(f"{unknown[0]} is not supported by /fetch_weights", unknown[0])
        target = int_at_least(body.get("target_version"), "target_version", 1)
        sync_dir, uri = _local(body.get("sync_dir"), "sync_dir"), _local(body.get("uri"), "uri")
        if sync_dir is None and uri is None:
            raise bad_request("sync_dir or uri is required", "sync_dir")
        for module in ("zstandard", "xxhash"):
            if importlib.util.find_spec(module) is None:
                raise not_supported("/fetch_weights", f"{module} is not installed: "
                                    "pip install 'rollout[skyrl]'")  # fmt: skip
        async with self.lock:
            if self.state is None:  # no init: the served model's own folder is the base
                source = self.ctl.model_source
                if source is None or not Path(source).is_dir():
                    raise APIError(409, "no base checkpoint: POST /init_weight_transfer_engine "
                                        "{\"init_info\": {\"base_model_path\"}} first",
                                   param="base_model_path", code="not_initialized")  # fmt: skip
                self.state = await self._read_base(source, "base_model_path")
            if target == self.version:  # served already
                self.staged, self.pending = None, False
                return {"status": "ok", "target_version": target}
            if self.staged is not None and self.staged[0] == target:
                return {"status": "ok", "target_version": target}
            if target < self.version:
                raise bad_request(f"target_version {target} is behind the applied version "
                                  f"{self.version}", "target_version")  # fmt: skip
            param = "uri" if uri is not None else "sync_dir"
            try:
                state = await asyncio.to_thread(self._chain, target, sync_dir, uri)
            except (OSError, ValueError) as e:
                raise bad_request(f"{param}: {e}; nothing was staged", param) from None
            self.staged, self.pending = (target, state), False
        return {"status": "ok", "target_version": target}

    def _chain(self, target: int, sync_dir: str | None, uri: str | None) -> dict:
        """The checkpoint at `target`: each delta after `version` replayed (a thread)."""
        state = dict(self.state)
        for v in range(self.version + 1, target + 1):
            if uri is not None and v == target:
                folder = Path(uri)
            elif sync_dir is not None:
                folder = delta_dir(sync_dir, v)
            else:
                raise ValueError(f"versions {self.version + 1}..{target - 1} come before uri's: "
                                 "give sync_dir")  # fmt: skip
            version, base, records = read_manifest(folder)
            if (version, base) != (v, v - 1):
                raise ValueError(f"{folder} holds version {version} on {base}, "
                                 f"expected {v} on {v - 1}")  # fmt: skip
            state.update(apply_delta(state, folder, records))
        return state

    def start(self) -> None:
        self.open, self.pending = True, False

    async def update(self, info: Any) -> dict:
        if not isinstance(info, dict):
            raise bad_request("update_info must be an object", "update_info")
        if not info.keys() & {"target_version", "version"}:
            raise not_supported("update_info", "vLLM's NCCL/IPC transfers; " + INSTEAD)
        if unknown := sorted(set(info) - DELTA_UPDATE):
            raise bad_request(f"update_info.{unknown[0]} is not supported",
                              f"update_info.{unknown[0]}")  # fmt: skip
        key = "target_version" if info.get("target_version") is not None else "version"
        target = int_at_least(info.get(key), f"update_info.{key}", 1)
        async with self.lock:
            if not self.open:
                raise APIError(409, "POST /start_weight_update first", code="invalid_state")
            if target == self.version and self.staged is None:
                return {"status": "ok"}  # already served
            if self.staged is None or self.staged[0] != target:
                raise bad_request(f"version {target} was not fetched: POST /fetch_weights first",
                                  f"update_info.{key}")  # fmt: skip
            current = await self.ctl.weight_version()
            try:
                checked_state_dict(await self.ctl.model_shapes(), self.staged[1], current + 1,
                                   current)  # fmt: skip
            except ValueError as e:
                raise bad_request(f"update_info: {e}; the served version {current} is unchanged",
                                  "update_info") from None  # fmt: skip
            self.pending = True
        return {"status": "ok"}

    async def finish(self, body: dict) -> dict:
        if unknown := sorted(set(body) - {"weight_version"}):
            raise bad_request(f"{unknown[0]} is not supported by /finish_weight_update", unknown[0])
        version = body.get("weight_version")
        if isinstance(version, str) and version.isdigit():
            version = int(version)  # SkyRL types it as a string
        if version is not None:
            int_at_least(version, "weight_version", 1)
        async with self.lock:
            pending, self.open, self.pending = self.pending, False, False
            if not pending:
                if version is not None:
                    raise bad_request("weight_version: no update between start and finish",
                                      "weight_version")  # fmt: skip
                return {"status": "ok", "weight_version": await self.ctl.weight_version()}
            current = await self.ctl.weight_version()
            if version is not None and version <= current:
                raise bad_request(f"weight_version must be > the served {current}, got "
                                  f"{version}", "weight_version")  # fmt: skip
            target, state = self.staged
            applied = await self.ctl.update_from_tensors(state, "update_info", version)
            self.state, self.version, self.staged = state, target, None
        return {"status": "ok", "weight_version": applied}

    async def collective_rpc(self, body: dict) -> dict:
        """SkyRL's worker methods, as what they mean here."""
        method, kwargs = body.get("method"), body.get("kwargs") or {}
        if not isinstance(method, str):
            raise bad_request("method must be a string", "method")
        if not isinstance(kwargs, dict):
            raise bad_request("kwargs must be an object", "kwargs")
        if body.get("args"):
            raise bad_request("args are not supported: pass kwargs", "args")
        if method in REFUSED_RPC:
            raise not_supported(f"collective_rpc method {method!r}", REFUSED_RPC[method])
        if method in RPC_KWARGS and (unknown := sorted(set(kwargs) - RPC_KWARGS[method])):
            raise bad_request(f"kwargs.{unknown[0]} is not supported by {method}",
                              f"kwargs.{unknown[0]}")  # fmt: skip
        if method == "skyrl_sleep_for_weight_sync":
            offload = kwargs.get("offload_kv", True)
            if not isinstance(offload, bool):
                raise bad_request("kwargs.offload_kv must be a boolean", "kwargs.offload_kv")
            await self.ctl.sleep(1 if offload else 2, ["kv_cache"])  # room for the update
        elif method == "skyrl_wake_for_weight_sync":
            tags = kwargs.get("tags")
            if tags is not None and not (isinstance(tags, list) and
                                         all(isinstance(t, str) for t in tags)):  # fmt: skip
                raise bad_request("kwargs.tags must be a list of strings", "kwargs.tags")
            await self.ctl.wake_up(tags)
        elif method == "skyrl_start_weight_update":  # 0.3.x's bracket
            if kwargs.get("is_checkpoint_format", True) is not True:
                raise not_supported("kwargs.is_checkpoint_format", "weights arrive in the "
                                    "checkpoint's (HF) format only")  # fmt: skip
            self.start()
        elif method == "skyrl_finish_weight_update":
            await self.finish({})
        else:
            raise not_supported(f"collective_rpc method {method!r}", "worker RPCs do not exist "
                                "here; " + INSTEAD)  # fmt: skip
        return {"results": [None]}
