"""SkyRL's checkpoint deltas (its `delta` weight-sync backend, skyrl 0.4): a folder
`<sync_dir>/delta-<version:08d>/` with `manifest.json` and safetensors payload files. Each record
names one changed tensor of the checkpoint; its payload is the zstd-compressed XOR of the
tensor's new bytes against the previous version's, and its checksum (xxh3-128 or sha256) is of
the new bytes. Unchanged tensors have no record.

`apply_delta` replays one delta onto a state dict the way SkyRL's `LocalCheckpointStore` patches
its checkpoint copy, but into new tensors: a delta that fails any check (a missing file, an
unknown tensor, a wrong dtype, shape or size, a checksum mismatch, a version out of order)
raises `ValueError` / `FileNotFoundError` naming it, and the state it was given is untouched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

MANIFEST = "manifest.json"
MAX_RECORDS = 1 << 20  # tensors of one model: more is not a manifest


@dataclass(frozen=True)
class Record:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # uncompressed: the tensor's size
    payload_file: str
    payload_key: str
    checksum: str
    algorithm: str


def delta_dir(sync_dir: str, version: int) -> Path:
    """Where SkyRL's `DeltaCheckpointPublisher` writes `version` under `sync_dir`."""
    return Path(sync_dir) / f"delta-{version:08d}"


def read_manifest(folder: Path) -> tuple[int, int, list[Record]]:
    """(version, base_version, records) of the delta in `folder`."""
    path = folder / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST} in {str(folder)!r}")
    try:
        data = json.loads(path.read_text())
        files = set(data.get("payload_files", []))
        records = [_record(item, files) for item in data.get("tensors", [])[: MAX_RECORDS + 1]]
        version, base = int(data["version"]), int(data["base_version"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a SkyRL delta manifest ({e!r})") from None
    if len(records) > MAX_RECORDS:
        raise ValueError(f"{path} lists more than {MAX_RECORDS} tensors")
    return version, base, records


def _record(item: dict, files: set[str]) -> Record:
    algorithm = item.get("checksum_algorithm", "xxh3-128" if "checksum" in item else "sha256")
    rec = Record(str(item["name"]), str(item["dtype"]), tuple(int(d) for d in item["shape"]),
                 int(item["uncompressed_num_bytes"]), str(item["payload_file"]),
                 str(item["payload_key"]), str(item.get("checksum") or item["sha256"]),
                 str(algorithm))  # fmt: skip
    if rec.payload_file not in files or Path(rec.payload_file).name != rec.payload_file:
        raise ValueError(f"payload_file {rec.payload_file!r} is not one of payload_files")
    return rec


def checksum(data: memoryview, algorithm: str) -> str:
    if algorithm == "xxh3-128":
        import xxhash  # the `skyrl` extra

        return xxhash.xxh3_128(data).hexdigest()
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise ValueError(f"unsupported checksum_algorithm {algorithm!r}")


def apply_delta(state: dict[str, torch.Tensor], folder: Path,
                records: list[Record]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The tensors `records` change, each `state`'s XOR its decompressed patch, every checksum
    verified; ValueError naming every tensor that fails."""
    import zstandard  # the `skyrl` extra

    problems: list[str] = []
    out: dict[str, torch.Tensor] = {}
    handles: dict[str, object] = {}
    try:
        for rec in records:
            base = state.get(rec.name)
            if base is None:
                problems.append(f"{rec.name}: not a tensor of the base checkpoint")
                continue
            dtype = str(base.dtype).removeprefix("torch.")
            if (dtype, tuple(base.shape)) != (rec.dtype, rec.shape):
                problems.append(f"{rec.name}: {rec.dtype}{list(rec.shape)} in the delta, "
                                f"{dtype}{list(base.shape)} in the checkpoint")  # fmt: skip
                continue
            old = base.contiguous().reshape(-1).view(torch.uint8).numpy()
            if rec.nbytes != old.nbytes:
                problems.append(f"{rec.name}: {rec.nbytes} bytes in the delta, {old.nbytes} here")
                continue
            handle = handles.get(rec.payload_file)
            if handle is None:
                handle = _open(folder / rec.payload_file)
                handles[rec.payload_file] = handle
            try:
                packed = handle.get_tensor(rec.payload_key).numpy().tobytes()
            except Exception as e:  # safetensors' own error type for a missing key
                problems.append(f"{rec.name}: payload {rec.payload_key!r} unreadable ({e})")
                continue
            try:
                patch = zstandard.ZstdDecompressor().decompress(packed, max_output_size=old.nbytes)
            except zstandard.ZstdError as e:
                problems.append(f"{rec.name}: the payload does not decompress ({e})")
                continue
            if len(patch) != old.nbytes:
                problems.append(f"{rec.name}: the patch has {len(patch)} bytes, not {old.nbytes}")
                continue
            new = np.bitwise_xor(old, np.frombuffer(patch, dtype=np.uint8))
            if checksum(memoryview(new), rec.algorithm) != rec.checksum:
                problems.append(f"{rec.name}: checksum mismatch")
                continue
            out[rec.name] = torch.from_numpy(new).view(base.dtype).reshape(base.shape)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    if problems:
        raise ValueError(f"bad delta in {str(folder)!r}: " + "; ".join(problems[:20]))
    return out


def _open(path: Path):
    if not path.is_file():
        raise FileNotFoundError(f"payload file {str(path)!r} is missing")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        handle.__enter__()
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path.name} is not a readable safetensors file ({e})") from None
    return handle
