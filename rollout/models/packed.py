"""MKL-packed linear weights for small fp32 CPU batches (the engine's decode steps).

With ~32 rows, sgemm spends a large share of every call re-packing the weight matrix, and a
decode step multiplies every weight of the model once. `cblas_sgemm_pack` done once per weight
version removes that: 25% of the matmul time with hot weights; a whole decode step (32 rows, one
thread, weights streamed from memory) went from 42.6 to 40.7 ms (small preset) and from 138 to
117 ms (medium). torch exposes the pair as `torch.ops.mkl._mkl_reorder_linear_weight` /
`_mkl_linear` (the ops inductor uses for frozen CPU linears).

A pack is only valid for the row count it was made for (the op falls back to F.linear for any
other), so one row count is packed at a time: a new one must repeat `STABLE` forwards in a row
first (decode batches keep their size for many steps; a pack costs about one weight copy).
Each weight is re-packed when its version counter or storage changes (update_weights, an
optimizer step on shared parameters, `.to()`), so a stale pack is never used. The packs cost
one extra copy of the weights in host memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _mkl_ops():
    try:
        if torch.backends.mkl.is_available():
            return torch.ops.mkl._mkl_reorder_linear_weight, torch.ops.mkl._mkl_linear
    except (AttributeError, RuntimeError):
        pass
    return None


_OPS = _mkl_ops()
STABLE = 4  # forwards in a row with the same row count before packing for it
MAX_ROWS = 256  # above this sgemm amortises its own packing over the rows


class PackedLinears:
    """Per model: packed copies of its linear weights for one row count, built lazily."""

    def __init__(self) -> None:
        self.enabled = True  # False: plain F.linear always (no extra weight copy)
        self.rows = 0  # the row count the packs are for (0: none)
        self._candidate = 0
        self._streak = 0
        # id(weight) -> (weight, data_ptr, version, packed)
        self._packs: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}

    def observe(self, rows: int, like: torch.Tensor) -> None:
        """Count one forward of `rows` rows over weights like `like` (switches packs when due)."""
        if not self.enabled:
            if self.rows:
                self.clear()
            return
        if (
            _OPS is None
            or like.device.type != "cpu"
            or like.dtype != torch.float32
            or rows > MAX_ROWS
            or rows == self.rows
        ):
            return
        if rows == self._candidate:
            self._streak += 1
        else:
            self._candidate, self._streak = rows, 1
        if self._streak >= STABLE:
            self.rows = rows
            self._packs.clear()

    def __call__(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        """lin(x): the base through the pack when x has the packed row count, plus a LoRA
        adapter's term when `lin` has one (rollout.models.lora: the base stays packed)."""
        out = self._base(x, lin)
        lora = getattr(lin, "lora_delta", None)
        return out if lora is None else out.add_(lora(x))

    def _base(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        w = lin.weight
        if x.dim() != 2 or x.shape[0] != self.rows or not w.dtype == x.dtype == torch.float32:
            return F.linear(x, w, lin.bias)
        packed = self._pack(w)
        if packed is None:
            return F.linear(x, w, lin.bias)
        return _OPS[1](x, packed, w, lin.bias, self.rows)

    def _pack(self, w: torch.Tensor) -> torch.Tensor | None:
        try:
            version = w._version
        except RuntimeError:  # an inference tensor: no version counter to trust
            return None
        entry = self._packs.get(id(w))
        if entry is not None and entry[0] is w and entry[1] == w.data_ptr() and entry[2] == version:
            return entry[3]
        if not w.is_contiguous():
            return None
        packed = _OPS[0](w.detach(), self.rows)
        self._packs[id(w)] = (w, w.data_ptr(), version, packed)
        return packed

    def clear(self) -> None:
        """Drop every pack (they are rebuilt when a stable row count comes back)."""
        self.rows = self._candidate = self._streak = 0
        self._packs.clear()

    # packs live at fixed addresses (MKL's rule) and are cheap to rebuild: never copy them
    def __deepcopy__(self, memo: dict) -> PackedLinears:
        twin = PackedLinears()
        twin.enabled = self.enabled
        return twin

    def __getstate__(self) -> dict:
        return self.__deepcopy__({}).__dict__
