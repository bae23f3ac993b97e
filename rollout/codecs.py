"""Wire codecs for request records: tensors as raw bytes, number lists packed, top-n as pairs.

msgpack carries only native values; these turn tensors and long number lists into compact bytes
(exact for every dtype) and back, and reject payloads that would not round-trip exactly.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch

_SCALARS = frozenset({type(None), bool, float, str, bytes})


def check_msgpack_native(value: Any, where: str) -> None:
    """Reject anything msgpack would not round-trip exactly (tuples, tensors, objects, huge ints)."""
    if type(value) in _SCALARS or isinstance(value, (bool, float, str, bytes)):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"{where}: int {value} does not fit in 64 bits")
    elif isinstance(value, list):
        for v in value:
            check_msgpack_native(v, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise ValueError(f"{where}: dict keys must be str or int, got {k!r}")
            check_msgpack_native(v, where)
    else:
        raise ValueError(f"{where}: {type(value).__name__} is not msgpack-native ({value!r})")


def serialize_tensor(t: torch.Tensor) -> dict[str, Any]:
    """{dtype, shape, data}: raw little-endian bytes, exact for every dtype (bf16 included)."""
    t = t.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": data}


_DTYPES: dict[str, torch.dtype] = {}  # wire name -> dtype, filled on first sight


def _dtype(name: Any) -> torch.dtype:
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {name!r}")
        _DTYPES[str(name)] = dtype
    return dtype


def deserialize_tensor(obj: dict[str, Any]) -> torch.Tensor:
    """A fresh, writable CPU tensor (one copy of the bytes; the wire buffer is not aliased)."""
    dtype = _dtype(obj["dtype"])
    shape, data = obj["shape"], obj["data"]
    if not (type(shape) is list and len(shape) == 1 and type(shape[0]) is int):  # not plain 1-D
        shape = [int(s) for s in shape]
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"tensor data has {len(data)} bytes, shape {shape} of {dtype} needs more")
    if not data:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(bytearray(data), dtype=dtype)
    return t if len(shape) == 1 else t.reshape(shape)


_NATIVE_LE = sys.byteorder == "little"


def number_list_codec(np_dtype: str, fmt: str, py: type):
    def enc(xs: list) -> bytes:
        return np.asarray(xs, dtype=np_dtype).tobytes() if len(xs) else b""

    def dec(b: Any) -> list:
        if isinstance(b, (bytes, bytearray)):
            if _NATIVE_LE:  # memoryview.cast is native-endian and ~3x cheaper than numpy here
                return memoryview(b).cast(fmt).tolist()
            return np.frombuffer(b, dtype=np_dtype).tolist()
        return [py(x) for x in b]  # hand-written dicts may carry plain lists

    return enc, dec


def encode_top_n(xs: list[dict[int, float]]) -> list:
    return [[list(d.keys()), list(d.values())] for d in xs]


def decode_top_n(xs: list) -> list[dict[int, float]]:
    if type(xs) is list and not xs:
        return []
    out = []
    for d in xs:
        pairs = d.items() if isinstance(d, dict) else zip(d[0], d[1], strict=True)
        out.append({int(k): float(v) for k, v in pairs})
    return out


def encode_rows(rows: list[torch.Tensor]) -> Any:
    """Equal-shaped per-token tensors (routed experts) as ONE packed tensor; [] when empty."""
    return serialize_tensor(torch.stack(rows)) if rows else []


def decode_rows(obj: Any) -> list[torch.Tensor]:
    """Inverse of `encode_rows`: views of one fresh tensor, one per token."""
    if type(obj) is list and not obj:
        return []
    return list(deserialize_tensor(obj).unbind(0))


def values_equal(a: Any, b: Any) -> bool:
    if type(a) is list and type(b) is list and any(isinstance(x, torch.Tensor) for x in a + b):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    return a == b
