"""`WeightStage`: receive and check the next weight version beside the serving one.

A plain update (`DynamicInferenceEngine.update_weights`) casts and copies the trainer's tensors
into the model between two steps, so decoding stops for the whole transfer. Staged
(`InferenceConfig.weight_update="staged"`) splits it in two:

1. `stage(state_dict, version)`, on any thread while the engine keeps stepping on the current
   weights: every check `update_weights` makes (a whole model, each name, shape and dtype), then
   a cast-and-copy into a second buffer that lives on the engine's device in the model's dtype.
   It touches no tensor the engine reads, so no forward can see a half-staged version. All or
   nothing: a check that fails, a copy that raises or an abort (`should_abort`) leaves nothing
   staged, and the current version serves on.
2. the flip (`DynamicInferenceEngine.flip_weights`), between two steps: each weight tensor
   swaps storage with its buffer (no copy; the old weights become the next stage's buffer).
   While CUDA graphs hold the weights' addresses the flip is a device-local copy instead (same
   dtype, already checked: one read and one write of the weights, the order of one decode
   step's weight read). Then the engine does exactly what `update_weights` does after its copy,
   so the version stamp, the KV policy and every staleness counter move as for a plain update.
   The step after the flip stamps the new version; none stamps a mix.

The buffer is allocated once and reused (it doubles the weights' memory on the device); `hold()`
keeps a second stage from overwriting it before its flip.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rollout.weights.state import check_compatible


class StagingAborted(RuntimeError):
    """The transfer being staged was given up (the trainer aborted it); nothing is staged."""


@dataclass
class Staged:
    """A complete, checked version in the stage's buffer, ready for `update_weights`."""

    version: int
    tensors: dict[str, torch.Tensor]
    seconds: float


class WeightStage:
    """The second copy of `model`'s weights that the next version is received into."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.lock = threading.Lock()  # one version in the buffer from stage to flip
        self._buffers: dict[str, torch.Tensor] | None = None
        self.staged: Staged | None = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Own the buffer from `stage` to the flip (a concurrent update waits)."""
        with self.lock:
            try:
                yield
            finally:
                self.staged = None

    def stage(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        current_version: int,
        should_abort: Callable[[], bool] | None = None,
    ) -> Staged:
        """Check `state_dict` as a whole model for `version` and copy it into the buffer;
        ValueError (checks) or StagingAborted before anything counts as staged."""
        t0 = time.perf_counter()
        self.staged = None
        targets = self._check(state_dict, version, current_version)
        buffers = self._buffers_for(targets)
        with torch.no_grad(), self._side_stream(buffers) as stream:
            for name, t in state_dict.items():
                if should_abort is not None and should_abort():
                    raise StagingAborted(f"staging version {version} was aborted")
                buffers[name].copy_(t)
            if stream is not None:
                stream.synchronize()  # staged means on the device, complete
        self.staged = Staged(version, {n: buffers[n] for n in state_dict},
                             time.perf_counter() - t0)  # fmt: skip
        return self.staged

    def _check(
        self, state_dict: Mapping[str, torch.Tensor], version: int, current: int
    ) -> dict[str, torch.Tensor]:
        """The same checks as `DynamicInferenceEngine.update_weights`, before any copy."""
        return check_update(self.model, state_dict, version, current, "staged update")

    def _buffers_for(self, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One buffer per model tensor, shaped, typed and placed like it (allocated once)."""
        if self._buffers is None:
            self._buffers = {n: torch.empty_like(t, memory_format=torch.contiguous_format)
                             for n, t in targets.items()}  # fmt: skip
        return self._buffers

    def release(self) -> int:
        """Free the buffer (the engine's weights were discarded); its bytes. Reallocated by the
        next stage."""
        with self.lock:
            freed = sum(b.untyped_storage().nbytes() for b in (self._buffers or {}).values())
            self._buffers, self.staged = None, None
        return freed

    def flip(self, staged: Staged, swap: bool) -> None:
        """Make the model's tensors hold `staged` (swap storage, or copy when `swap` is off);
        tied names share one tensor, which flips once."""
        targets = self.model.state_dict(keep_vars=True)
        done: set[int] = set()
        with torch.no_grad():
            for name, buf in staged.tensors.items():
                target = targets[name]
                if id(target) in done:
                    continue
                done.add(id(target))
                if swap:
                    old = target.data
                    target.data = buf
                    self._buffers[name] = old
                else:
                    target.copy_(buf)
        self.staged = None

    @contextlib.contextmanager
    def _side_stream(self, buffers: dict[str, torch.Tensor]) -> Iterator[Any]:
        """On CUDA, copy on a stream of its own: decode kernels on the engine's stream are not
        queued behind the transfer. It first waits for the last flip's reads of the buffer."""
        device = next(iter(buffers.values())).device
        if device.type != "cuda":
            yield None
            return
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield stream


def check_update(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], version: int, current: int, what: str
) -> dict[str, torch.Tensor]:
    """The model's tensors `state_dict` loads into, for an update named `what`; ValueError naming
    every problem. One rule for in-place and staged updates, so neither accepts what the other
    refuses."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= current:
        raise ValueError(f"version must be an int > current {current}, got {version!r}")
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise ValueError("state_dict must be a non-empty mapping of name -> tensor")
    not_tensors = [f"{k}: {type(t).__name__}" for k, t in state_dict.items()
                   if not isinstance(t, torch.Tensor)]  # fmt: skip
    if not_tensors:
        raise ValueError(f"{what} rejected: expected tensors, got {not_tensors[:5]}")
    targets = model.state_dict(keep_vars=True)
    specs = {}  # a floating-point tensor casts on copy: it counts as the target's dtype
    for name, t in state_dict.items():
        cast = t.dtype.is_floating_point and name in targets
        specs[name] = (targets[name].dtype if cast else t.dtype, tuple(t.shape))
    try:
        check_compatible(targets, specs)
    except ValueError as e:
        raise ValueError(f"{what} rejected, old weights still serve: {e}") from None
    _check_tied(targets, state_dict, what)
    return targets


def _check_tied(
    targets: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor], what: str
) -> None:
    """Names that share one model tensor (tied embeddings) must arrive with equal values: an
    in-place copy would keep the last, a staged flip the first, so either would serve a model
    the trainer does not have."""
    first: dict[int, str] = {}
    for name in state_dict:
        if name not in targets:
            continue
        other = first.setdefault(id(targets[name]), name)
        if other != name and not torch.equal(state_dict[other], state_dict[name]):
            raise ValueError(f"{what} rejected, old weights still serve: {other} and {name} are "
                             "tied in the model but differ in the update")  # fmt: skip
