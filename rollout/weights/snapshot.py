"""`WeightSnapshot`: the last weights pushed to the engines, so an engine that starts or joins
later gets exactly them.

A restarted engine must serve the version its peers serve, not the checkpoint the cluster
started from. The snapshot keeps the last state_dict the engines committed and writes it, once per
version, to a safetensors file a new engine process loads over the model it builds from the
original source (`build_engine(weights_file=...)`). An engine that joined from another host is
sent `state_dict()` instead (the trainer's module may already be a step further: never send it).

Memory: `mode="memory"` keeps one CPU copy of the weights in the trainer process (the model's
size in its own dtype: 1 GB for 0.5B parameters in bf16) and writes the file only when an engine
restarts; `mode="disk"` writes the file on every update instead (no resident copy; one file write
of the model's size per update). Aliased tensors (tied embeddings) are stored once.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

MODES = ("memory", "disk")
_ALIASES = "rollout_aliases"  # safetensors metadata key: {alias name: stored name}


class WeightSnapshot:
    def __init__(self, directory: Callable[[], Path], mode: str = "memory") -> None:
        """`directory()` gives the folder for the file (created on first use)."""
        if mode not in MODES:
            raise ValueError(f"weights snapshot mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.directory = directory
        self.version: int | None = None
        self._tensors: dict[str, torch.Tensor] | None = None
        self._aliases: dict[str, str] = {}
        self._file: Path | None = None
        self._lock = threading.Lock()

    def save(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Keep `state_dict` as `version` (copied: the trainer goes on changing its tensors).
        Memory mode copies into the last version's tensors where they fit: fresh host pages
        cost a fault and a zeroed page each, several times the copy itself."""
        with self._lock:  # emptied while refilled: a failed copy leaves no mixed version
            kept, self._tensors, self.version = self._tensors, None, None
            old_file, old_aliases = self._file, self._aliases
        if kept is None and old_file is not None:  # disk mode: the last version is the file
            kept, old_aliases = _read(str(old_file))
        tensors, aliases = _unique_cpu_copies(state_dict, kept or {})
        _carry_the_rest(tensors, aliases, kept or {}, old_aliases)
        with self._lock:
            self.version, self._tensors, self._aliases, self._file = version, tensors, aliases, None
            if self.mode == "disk":
                self._write()
                self._tensors = None

    def engine_kwargs(self) -> dict[str, Any]:
        """`build_engine` kwargs that start an engine from the snapshot; {} before any update."""
        with self._lock:
            if self.version is None:
                return {}
            if self._file is None:
                self._write()
            return {"weights_file": str(self._file), "weight_version": self.version}

    def state_dict(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, its tensors by name: aliases share one tensor); None before any update.
        Disk mode reads the file: one transient copy while the caller sends it."""
        with self._lock:
            if self.version is None:
                return None
            if self._tensors is None:
                return self.version, load_snapshot(str(self._file))
            tensors = dict(self._tensors)
            for alias, name in self._aliases.items():
                tensors[alias] = tensors[name]
            return self.version, tensors

    def _write(self) -> None:
        from safetensors.torch import save_file

        directory = self.directory()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"weights-v{self.version}.safetensors"
        meta = {_ALIASES: json.dumps(self._aliases)}
        save_file(self._tensors, str(path), metadata=meta)
        if self._file is not None and self._file != path:
            self._file.unlink(missing_ok=True)
        for old in directory.glob("weights-v*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        self._file = path


def _carry_the_rest(
    tensors: dict[str, torch.Tensor],
    aliases: dict[str, str],
    kept: Mapping[str, torch.Tensor],
    old_aliases: Mapping[str, str],
) -> None:
    """A partial update (a LoRA adapter alone, or a LoRA model's base alone: rollout.models.lora)
    leaves the other tensors at their last pushed values; a whole model replaces every name."""
    for name, t in kept.items():
        if name not in tensors and name not in aliases and name not in old_aliases:
            tensors[name] = t
    for alias, name in old_aliases.items():
        if alias not in tensors and alias not in aliases and name in tensors:
            aliases[alias] = name


def _unique_cpu_copies(
    state_dict: Mapping[str, torch.Tensor], reuse: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """CPU copies, one per distinct tensor, into `reuse[name]` where shape and dtype match;
    aliases (same storage, shape, strides) by name."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state_dict.items():
        t = t.detach()
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        old = reuse.get(name)
        if old is not None and old.shape == t.shape and old.dtype == t.dtype:
            tensors[name] = old.copy_(t)
        else:
            tensors[name] = t.to("cpu", copy=True).contiguous()
    return tensors, aliases


def load_snapshot(path: str) -> dict[str, torch.Tensor]:
    """A snapshot file -> state_dict with every name (aliases point at the same tensor)."""
    tensors, aliases = _read(path)
    for alias, name in aliases.items():
        tensors[alias] = tensors[name]
    return tensors


def _read(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        aliases = json.loads((f.metadata() or {}).get(_ALIASES, "{}"))
    return tensors, aliases
