"""The GPU check's memory stage: what `suspend` gives back to the device, per mode.

The engine's reported bytes are compared with the change in the driver's free memory, and a
second process on the GPU stands in for the colocated trainer (`TrainerProbe`): it fills the
device to half the pool and tries a training step of 0.9 x the pool, which must fit only while
the engine is suspended (offload, recompute). On CPU the twin is the process RSS.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_check import Ctx

MiB = 2**20
GiB = 2**30


def stage_suspend_memory(ctx: Ctx) -> None:
    import torch

    from rollout.engine import DynamicInferenceEngine, InferenceConfig
    from rollout.models import ModelConfig, build_model, kv_bytes_per_block
    from rollout.sampling import SamplingParams

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    pool = 2 * GiB if ctx.cuda else 64 * MiB  # > glibc's mmap threshold: free() returns it
    config = ModelConfig.preset("small" if ctx.cuda else "tiny")
    model = build_model(config, seed=0).to(device=ctx.device, dtype=dtype).eval()
    blocks = pool // kv_bytes_per_block(config, 16, dtype)  # the whole pool, not just what
    cfg = InferenceConfig(num_blocks=blocks, max_requests=4, max_sequence_length=256)  # 4 need
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 20, 40, 12)]
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=16, ignore_eos=True)
    want = [r.generated_tokens for r in DynamicInferenceEngine(model, None, cfg).generate(prompts, sp)]  # fmt: skip
    # CUDA: device free memory. CPU: the device is host memory, so the twin is the process RSS
    # (offload then moves bytes within it: nothing comes back, by design).
    tol = (4 * MiB + pool // 100) if ctx.cuda else pool // 5
    ctx.details.update(pool_bytes=pool, tolerance_bytes=tol,
                       measure="cuda.mem_get_info" if ctx.cuda else "process RSS")  # fmt: skip
    probe = TrainerProbe() if ctx.cuda else None
    try:
        for mode in ("persist", "offload", "recompute"):
            eng = DynamicInferenceEngine(model, None, cfg)
            ids = [eng.add_request(None, p, sp).request_id for p in prompts]
            for _ in range(4):  # mid-generation: KV in use, requests in flight
                eng.step()
            # Twice, as every training step does: the first cycle also pays one-time costs
            # (lazy CUDA init of the copy paths), so the steady cycle is the one checked.
            first = suspend_cycle(ctx, eng, mode, tol, probe, steady=False)
            for _ in range(2):
                eng.step()
            row = suspend_cycle(ctx, eng, mode, tol, probe, steady=True)
            row["first_cycle"] = first
            done = {r.request_id: r.merge() for r in drain(eng)}
            row["outputs_equal_unsuspended"] = [done[i].generated_tokens for i in ids] == want
            ctx.details[mode] = row
            ctx.check(f"{mode}_outputs_equal", row["outputs_equal_unsuspended"])
            eng.close()
            del eng
    finally:
        if probe is not None:
            probe.close()


def device_free_bytes(cuda: bool) -> int:
    """What the device could hand out now (CPU twin: minus the process RSS)."""
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    import psutil

    return -psutil.Process().memory_info().rss


def suspend_cycle(ctx: Ctx, eng: Any, mode: str, tol: int, probe: TrainerProbe | None,
                  steady: bool) -> dict[str, Any]:  # fmt: skip
    """Free memory before / while suspended / after resume, and (CUDA) the training step that
    the trainer probe tries with the device filled to half the pool."""
    import gc

    import torch

    gc.collect()  # earlier engines' pools, and this process's cache, out of the picture
    if ctx.cuda:
        torch.cuda.empty_cache()
        probe.call("fill", eng.kv.nbytes // 2)
    before = device_free_bytes(ctx.cuda)
    step_bytes = int(eng.kv.nbytes * 0.9)
    fits_before = ctx.cuda and bool(probe.call("fits", step_bytes))
    reported = eng.suspend(mode)
    during = device_free_bytes(ctx.cuda)
    fits_during = ctx.cuda and bool(probe.call("fits", step_bytes))
    eng.resume()
    after = device_free_bytes(ctx.cuda)
    if ctx.cuda:
        probe.call("release")
    got_back = during - before
    device_is_host = not ctx.cuda
    expect_reported = 0 if mode == "persist" else eng.kv.nbytes
    expect_back = 0 if mode == "persist" or (device_is_host and mode == "offload") else reported
    row = {"reported_freed_bytes": reported, "device_got_back_bytes": got_back,
           "free_before": before, "free_suspended": during, "free_after_resume": after,
           "expected_back_bytes": expect_back}  # fmt: skip
    ctx.check(f"{mode}_reported_bytes", reported == expect_reported)
    ctx.check(f"{mode}_device_got_back", abs(got_back - expect_back) <= tol)
    if not steady:
        return row
    ctx.check(f"{mode}_resume_takes_it_again", abs(before - after) <= tol)
    if ctx.cuda:
        row.update(training_step_bytes=step_bytes, fits_before=fits_before,
                   fits_suspended=fits_during)  # fmt: skip
        ctx.check(f"{mode}_training_step_needs_the_pool", not fits_before)
        ctx.check(f"{mode}_training_step_fits_suspended", fits_during == (mode != "persist"))
    return row


class TrainerProbe:
    """A second process on the GPU standing in for the colocated trainer. It holds the ballast
    and tries the training step, so what it gets is what the driver really has free: the engine
    process's caching allocator cannot lend it a block the engine freed but kept."""

    def __init__(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_probe_main, args=(child,), daemon=True)
        self.proc.start()
        self.call("ready")

    def call(self, op: str, nbytes: int = 0) -> int:
        import msgpack

        self.conn.send_bytes(msgpack.packb([op, nbytes]))
        if not self.conn.poll(60):
            raise RuntimeError(f"trainer probe silent on {op!r} (exit code {self.proc.exitcode})")
        ok, value = msgpack.unpackb(self.conn.recv_bytes())
        if not ok:
            raise RuntimeError(f"trainer probe failed on {op!r}: {value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send_bytes(b"")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _probe_main(conn: Any) -> None:
    import msgpack
    import torch

    torch.cuda.init()
    ballast = None
    while raw := conn.recv_bytes():
        op, nbytes = msgpack.unpackb(raw)
        try:
            if op == "fill":
                ballast = None
                ballast = fill_device(nbytes)
                value = torch.cuda.mem_get_info()[0]
            elif op == "fits":
                value = training_step_fits(nbytes)
            elif op == "release":
                ballast = None
                torch.cuda.empty_cache()
                value = torch.cuda.mem_get_info()[0]
            else:
                value = torch.cuda.mem_get_info()[0]
            conn.send_bytes(msgpack.packb([True, value]))
        except Exception as e:
            conn.send_bytes(msgpack.packb([False, f"{type(e).__name__}: {e}"]))
    del ballast


def fill_device(leave: int) -> Any:
    """Take all free device memory but `leave` bytes, so that a training step of the pool's size
    fits only if the engine really gives its KV back."""
    import torch

    torch.cuda.empty_cache()
    size = torch.cuda.mem_get_info()[0] - leave
    for _ in range(8):  # fragmentation: back off until the allocator can place it
        try:
            return torch.empty(max(0, size - size % (2 * MiB)), dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            size -= 256 * MiB
    raise RuntimeError(f"could not fill the device down to {leave} free bytes")


def training_step_fits(nbytes: int) -> bool:
    """Allocate and touch `nbytes` as a training step would (activations, grads)."""
    import torch

    try:
        x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        x.fill_(1.0)
        torch.cuda.synchronize()
        del x
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def drain(eng: Any) -> list[Any]:
    done = []
    while eng.has_unfinished_requests():
        done.extend(eng.step().finished)
    return done
