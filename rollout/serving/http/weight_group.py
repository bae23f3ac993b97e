"""The trainer's weight group, as SGLang's `/init_weights_update_group` and AReaL's
`/areal_init_weights_update_group` form it: this server joins the trainer's torch.distributed
group (rank `rank_offset` of `world_size`, the store at `tcp://master_address:master_port`,
prefixed by `group_name`: exactly their `init_custom_process_group`) and receives each named
tensor by broadcast from rank 0. gloo on CPU; nccl is refused by name (this process holds no
GPU: the engines do). What arrives is relayed to the engines by the trainer path
(control.Control.update_from_tensors), never applied here.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, rendezvous

from rollout.serving.http.schemas import bad_request

BACKENDS = ("gloo",)
DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}
MAX_GROUP_TENSORS = 100_000


class WeightGroup:
    """One joined group; `receive` blocks (call it from a thread)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float = 300.0) -> None:  # fmt: skip
        timeout = datetime.timedelta(seconds=timeout_s)
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        self.name = group_name
        self.pg, _ = _new_process_group_helper(world_size, rank, [], backend,
                                               PrefixStore(group_name, store),
                                               group_name=group_name, backend_options=None,
                                               timeout=timeout)  # fmt: skip

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict:
        """Each named tensor, broadcast by rank 0 in this order."""
        out = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(tuple(shape), dtype=DTYPES[dtype])
            dist.broadcast(t, group_src=0, group=self.pg)
            out[name] = t
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a group not in torch's registry: nothing to drop
            dist.destroy_process_group(self.pg)
        self.pg = None


async def join(control: Any, body: dict) -> dict:
    """SGLang's `/init_weights_update_group` and AReaL's `/areal_init_weights_update_group`:
    `control` (control.Control) joins the group `body` names, or a 400 naming the field."""
    await control.join_group(check_group_args(body))
    return {"success": True, "message": f"joined weight group {body['group_name']!r}"}


def check_group_args(body: dict) -> tuple:
    """(master_address, master_port, rank_offset, world_size, group_name, backend) or a 400.
    `master_port` may come as a string of digits (AReaL sends it so)."""
    port = body.get("master_port")
    if isinstance(port, str) and port.isdigit():
        body = {**body, "master_port": int(port)}
    fields = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int,
              "group_name": str}  # fmt: skip
    for name, kind in fields.items():
        if type(body.get(name)) is not kind:
            raise bad_request(f"{name} must be a {kind.__name__}", name)
    backend = body.get("backend") or "gloo"
    if backend not in BACKENDS:
        raise bad_request(f"backend {backend!r} is not supported by this server (gloo: the "
                          "weights pass through this CPU process to the engines)", "backend")  # fmt: skip
    rank, world = body["rank_offset"], body["world_size"]
    if not 1 <= rank < world:
        raise bad_request(f"rank_offset must be in [1, world_size), got {rank}", "rank_offset")
    if not 1 <= body["master_port"] <= 65535:
        raise bad_request("master_port must be in [1, 65535]", "master_port")
    return (body["master_address"], body["master_port"], rank, world, body["group_name"],
            backend)  # fmt: skip


def check_meta(body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of an update over the group, or a 400 naming the field."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not names:
        raise bad_request("names must be a non-empty list of tensor names", "names")
    if len(names) > MAX_GROUP_TENSORS:
        raise bad_request(f"at most {MAX_GROUP_TENSORS} names per update", "names")
    if not isinstance(dtypes, list) or len(dtypes) != len(names):
        raise bad_request("dtypes must be a list, one per name", "dtypes")
    dtypes = [str(d).removeprefix("torch.") for d in dtypes]
    if bad := [d for d in dtypes if d not in DTYPES]:
        raise bad_request(f"dtype {bad[0]!r} is not one of {sorted(DTYPES)}", "dtypes")
    if (
        not isinstance(shapes, list)
        or len(shapes) != len(names)
        or not all(
            isinstance(s, list) and all(type(x) is int and x >= 0 for x in s) for s in shapes
        )
    ):
        raise bad_request("shapes must be a list of int lists, one per name", "shapes")
    return names, dtypes, shapes
