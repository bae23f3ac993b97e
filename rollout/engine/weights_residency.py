"""`WeightsResidency`: free the model's weights while the engine sleeps, and know when they are back.

vLLM's sleep (level 1 offloads the weights to host memory, level 2 discards them) mapped onto
our engine. What is released is exactly what a weight update replaces: every tensor of the
model's `state_dict` (parameters and persistent buffers; tied names share one storage, freed
once). Non-persistent buffers (rotary tables) stay.

Each storage is resized to zero bytes: tensors keep their shapes, dtypes and identities, so the
update checks (rollout.engine.staging.check_update) and the model's own references still work,
while no byte of the weights stays on the device.

- "offload": each storage is first copied to host memory, and `restore()` copies it back (on
  resume, or before an update writes into it). On a CPU engine the weights already live in host
  memory: nothing moves and nothing is freed (the answer says so).
- "discard": the weights are gone (a storage that cannot be resized is swapped for the
  tensors' own first, then freed the same way: `_own`). `materialize()` gives every storage fresh, uninitialised
  memory for an update to copy into; until an update has landed (`loaded()`) the engine is
  `missing` its weights and must not compute: a forward over that memory would be garbage.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

WEIGHT_MODES = ("keep", "offload", "discard")  # SUSPEND's `weights`: what happens to them
HOST_NOTE = "in host memory already (a CPU engine): nothing moved"


def on_host(model: nn.Module) -> bool:
    """The weights already live in host memory (a CPU engine): offloading moves nothing."""
    return next(model.parameters()).device.type == "cpu"


class WeightsResidency:
    """Where the weights of `model` are: resident, offloaded to host, or discarded."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state = "resident"  # | "offloaded" | "discarded"
        self.missing = False  # discarded and not yet replaced by an update
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # offloaded copies
        self._sizes: list[tuple[torch.UntypedStorage, int]] = []  # released storages, their bytes
        self._groups: list[set[str]] = []  # the names living in each released storage

    def _storages(self) -> list[tuple[torch.UntypedStorage, set[str], list[torch.Tensor]]]:
        """Each distinct storage behind the state dict, the names and tensors that live in it."""
        out: dict[int, tuple[torch.UntypedStorage, set[str], dict[int, torch.Tensor]]] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            s = t.untyped_storage()
            entry = out.setdefault(s.data_ptr() or id(s), (s, set(), {}))
            entry[1].add(name)
            entry[2][id(t)] = t
        return [(s, names, list(ts.values())) for s, names, ts in out.values()]

    @staticmethod
    def _own(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
        """A storage numpy has seen (`Tensor.numpy()`, e.g. the serving identity's digest) or
        that torch did not allocate (a transfer buffer the model adopted) cannot be resized:
        each tensor moves to memory of its own, which can, and the old storage goes with its
        last reference (its content is not kept: only a discard comes here)."""
        for t in tensors:
            t.data = torch.empty_like(t)
        return [t.untyped_storage() for t in tensors]

    def release(self, mode: str) -> dict:
        """Free the weights per `mode` ("offload" or "discard"); what happened, and the bytes
        the device got back. A second release only deepens it (offloaded -> discarded)."""
        if mode not in WEIGHT_MODES[1:]:
            raise ValueError(f"weights must be one of {WEIGHT_MODES[1:]}, got {mode!r}")
        if mode == "offload" and on_host(self.model):
            return {"weights": HOST_NOTE, "weights_bytes_freed": 0}
        if self.state == "discarded" or (self.state == "offloaded" and mode == "offload"):
            return {"weights": self.state, "weights_bytes_freed": 0}
        if self.state == "offloaded":  # -> discarded: drop the host copies
            self._host.clear()
            self.state, self.missing = "discarded", True
            return {"weights": self.state, "weights_bytes_freed": 0}
        groups = self._storages()
        stuck = sorted(min(ns) for s, ns, _ in groups if not s.resizable())
        if stuck and mode == "offload":
            raise RuntimeError(f"cannot offload the weights: {stuck[:3]} live in memory torch "
                               "did not allocate")  # fmt: skip
        freed = 0
        self._groups = [ns for _, ns, _ in groups]
        for s, _, tensors in groups:
            freed += s.nbytes()
            if mode == "offload":
                host = torch.empty(s.nbytes(), dtype=torch.uint8,
                                   pin_memory=torch.cuda.is_available())  # fmt: skip
                host.untyped_storage().copy_(s)
                self._host.append((s, host))
            for own in [s] if s.resizable() else self._own(tensors):
                self._sizes.append((own, own.nbytes()))
                own.resize_(0)
        self.state = "offloaded" if mode == "offload" else "discarded"
        self.missing = mode == "discard"
        return {"weights": self.state, "weights_bytes_freed": freed}

    def check_covers(self, names: Iterable[str]) -> None:
        """After a discard the next update must rebuild every storage (a LoRA update of the
        adapter alone would leave the base as uninitialised memory); ValueError otherwise."""
        if not self.missing:
            return
        given = set(names)
        lacking = sorted(min(ns) for ns in self._groups if not ns & given)
        if lacking:
            raise ValueError(f"the weights were discarded (sleep level 2): the next update must "
                             f"carry the whole model; missing {lacking[:5]}")  # fmt: skip

    def materialize(self) -> None:
        """Give every released storage its memory back: the host copy when offloaded, fresh
        uninitialised memory when discarded (an update fills it; `missing` until `loaded()`)."""
        for s, n in self._sizes:
            s.resize_(n)
        for s, host in self._host:
            s.copy_(host.untyped_storage())
        self._sizes.clear()
        self._host.clear()
        if self.state == "offloaded":
            self.state = "resident"

    def restore(self) -> None:
        """Bring offloaded weights back (resume); discarded ones wait for an update."""
        if self.state == "offloaded":
            self.materialize()

    def loaded(self) -> None:
        """An update wrote every tensor: the weights are whole again."""
        self.state, self.missing = "resident", False
