"""SkyRL 0.4's trainer side of its `delta` weight sync, run as its own process against servers:
its own `DeltaCheckpointPublisher` writes each step's delta and its own `SkyrlWeightSyncClient`
makes the calls `DeltaTrainerWeightTransferEngine` makes (trainer_init, then
_apply_receiver_update per step). That engine module imports vLLM, so its call sequence is
copied here line by line. skyrl 0.4 declares Python >= 3.12 and its package __init__s need it;
the modules used here do not, so they load from the unpacked wheel without those __init__s.

    python skyrl04_trainer.py WHEEL_DIR SERVER_URL BASE_DIR SYNC_DIR STEP_DIR [STEP_DIR ...]

Prints one JSON line per step: {"target_version", "records"}; a failed call exits non-zero
with SkyRL's own error message.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

from safetensors import safe_open

PKG = "skyrl.backends.skyrl_train.weight_sync"


def load(wheel: str) -> tuple[types.ModuleType, types.ModuleType]:
    parts = [*PKG.split("."), "delta"]
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(Path(wheel, *parts[:i]))]
        sys.modules[name] = pkg
    return (importlib.import_module(f"{PKG}.control_plane"),
            importlib.import_module(f"{PKG}.delta.checkpoint"))  # fmt: skip


def source(folder: str):
    """A `WeightSource`: (HF name, tensor) pairs, as a trainer's gathered state dict."""
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


def main(wheel: str, url: str, base: str, sync_dir: str, *steps: str) -> None:
    control_plane, checkpoint = load(wheel)
    client = control_plane.SkyrlWeightSyncClient([url], data_parallel_size=1)
    # DeltaTrainerWeightTransferEngine.trainer_init
    client.init_weight_transfer_engine({
        "base_model_path": base, "local_checkpoint_dir": f"{sync_dir}-local",
        "cloud_download_workers": 4, "checkpoint_load_format": "vllm_multi_thread_safetensors",
        "multi_thread_safetensors_max_workers": 8})  # fmt: skip
    publisher = checkpoint.DeltaCheckpointPublisher(
        base_model_path=base, sync_dir=sync_dir, publish_staging_dir=f"{sync_dir}-staging"
    )
    for step in steps:
        # send_weights, then _apply_receiver_update
        result = publisher.create_delta_files(source(step))
        update_info = publisher.publish(result)
        target_version = int(update_info.get("target_version", update_info.get("version")))
        client.fetch_weights(target_version=target_version,
                             sync_dir=update_info.get("sync_dir", sync_dir),
                             uri=update_info.get("uri"))  # fmt: skip
        client.pause_generation()
        try:
            client.reset_prefix_cache(reset_running_requests=True)
            client.start_weight_update()
            client.update_weights(update_info)
            client.finish_weight_update()
        finally:
            client.resume_generation()
        print(json.dumps({"target_version": target_version, "records": len(result.records)}),
              flush=True)  # fmt: skip
    client.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
