"""Data-parallel trainer ranks under torchrun (gloo on CPU, nccl on CUDA).

Rank 0 alone owns the RolloutManager: it spawns or attaches to the engines, collects each batch
and pushes weights. Every rank holds the same model wrapped in DistributedDataParallel and trains
on its share of the batch: rank 0 collates the samples into tensors and scatters contiguous rows
(whole GRPO groups) with `torch.distributed`, never pickled objects. DDP averages the gradients,
so after each optimizer step every rank holds rank 0's parameters, the ones it pushes.

Without torchrun (no WORLD_SIZE in the environment) `TrainerGroup.from_env` returns None and
nothing here runs: one process trains as it always did.

The trainer ranks hold torch.distributed's default group, as trainer frameworks do; weight sync
to engine processes builds groups of its own beside it (rollout.weights.rendezvous.open_group).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

# Dtypes a shared batch may hold, by the code its header sends (bool travels as uint8).
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
MAX_DIMS = 4
# The other ranks wait inside a collective while rank 0 warm-starts or generates a batch: minutes
# with long rollouts, past NCCL's 10-minute default. A rank that dies ends the job through
# torchrun, not through this timeout.
TIMEOUT = datetime.timedelta(hours=2)


@dataclass(frozen=True)
class TrainerGroup:
    """This process's place among the trainer ranks; `device` holds collective tensors."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: torch.device) -> TrainerGroup | None:
        """Join torchrun's group (env:// rendezvous) for a model on `device`: nccl and
        cuda:LOCAL_RANK on CUDA (so "cuda" names this rank's GPU), gloo on CPU. None without
        torchrun."""
        if "WORLD_SIZE" not in os.environ:
            return None
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
        return cls(dist.get_rank(), dist.get_world_size(), device)

    def close(self) -> None:
        """Destroy the group, after the DDP wrappers nothing refers to any more: one still alive
        when its group goes can abort the process as it exits (gloo)."""
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        """`model` under DDP: rank 0's parameters are copied to every rank here, and gradients
        are averaged at each synchronised backward."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def share(
        self, batch: Mapping[str, Tensor] | None, keys: Sequence[str], unit: int
    ) -> dict[str, Tensor]:
        """This rank's rows of `batch[k]` for each of `keys`: rank 0 passes the batch (others
        None) and every rank gets a contiguous, equal share of whole `unit`-row blocks (GRPO
        groups stay together, so group advantages need nothing from another rank)."""
        header = torch.zeros(len(keys), 2 + MAX_DIMS, dtype=torch.int64)
        if self.is_main:
            if batch is None:
                raise ValueError("rank 0 shares the batch: pass it")
            header = _header(batch, keys, self.world_size * unit)
        header = self._broadcast(header)
        out = {}
        for i, key in enumerate(keys):
            dtype, shape = DTYPES[int(header[i, 0])], header[i, 2 : 2 + int(header[i, 1])].tolist()
            wire = torch.uint8 if dtype == torch.bool else dtype
            mine = torch.empty([shape[0] // self.world_size, *shape[1:]], dtype=wire, device=self.device)  # fmt: skip
            parts = None
            if self.is_main:
                full = batch[key].to(self.device, wire).contiguous()
                parts = list(full.chunk(self.world_size))
            dist.scatter(mine, parts, src=0)
            out[key] = mine.to(dtype)
        return out

    def all_sum(self, x: Tensor) -> Tensor:
        """The sum of `x` over the ranks."""
        x = x.detach().to(self.device, torch.float64).clone()
        dist.all_reduce(x)
        return x

    def _broadcast(self, x: Tensor) -> Tensor:
        x = x.to(self.device)
        dist.broadcast(x, src=0)
        return x.cpu()


def _header(batch: Mapping[str, Tensor], keys: Sequence[str], rows_unit: int) -> Tensor:
    """One row per key: dtype code, ndim, shape (zero-padded); checks the rows split evenly."""
    header = torch.zeros(len(keys), 2 + MAX_DIMS, dtype=torch.int64)
    for i, key in enumerate(keys):
        t = batch[key]
        if t.dtype not in DTYPES or not 1 <= t.dim() <= MAX_DIMS:
            raise ValueError(f"{key}: cannot share a {t.dtype} tensor of {t.dim()} dims")
        if t.shape[0] % rows_unit:
            raise ValueError(
                f"{key}: {t.shape[0]} rows do not split into whole groups over the trainer ranks "
                f"(a multiple of {rows_unit} is needed: rollout.prompts_per_step must be a "
                "multiple of the number of ranks)"
            )
        header[i, 0], header[i, 1] = DTYPES.index(t.dtype), t.dim()
        header[i, 2 : 2 + t.dim()] = torch.tensor(t.shape)
    return header


def grad_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
    """Around one micro-batch's backward: DDP averages gradients only when `sync` (the last
    micro-batch before an optimizer step); the others accumulate locally under `no_sync`."""
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def weights_digest(model: nn.Module) -> str:
    """sha256 of the parameters and buffers, in state_dict order: equal on ranks that hold the
    same weights bit for bit."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def trainer_group(device: torch.device) -> Iterator[TrainerGroup | None]:
    """`TrainerGroup.from_env(device)` for the duration of a run, the group destroyed after."""
    group = TrainerGroup.from_env(device)
    try:
        yield group
    finally:
        if group is not None:
            group.close()
