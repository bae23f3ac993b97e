"""The GPU check's decode profile: one decode step with and without CUDA graphs, under the
torch profiler (wall vs device-busy ms, kernels and host syncs per step, the top ops)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_check import Ctx

MiB = 2**20


def stage_decode_profile(ctx: Ctx) -> None:
    """Where a decode step's time goes: wall time per step against the device's busy time (a
    launch-bound step shows wall >> kernels), kernels and host syncs per step, the top ops."""
    import torch

    from rollout.engine import DynamicInferenceEngine, InferenceConfig
    from rollout.models import ModelConfig, build_model

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    size, batch, steps = ("small", 32, 20) if ctx.cuda else ("tiny", 4, 4)
    config = ModelConfig.preset(size)
    model = build_model(config, seed=0).to(device=ctx.device, dtype=dtype).eval()
    ctx.details.update(model=size, dtype=str(dtype), batch=batch, steps=steps)
    for graphs in (False, True):
        cfg = InferenceConfig(max_sequence_length=512, kv_cache_memory_bytes=256 * MiB,
                              cuda_graphs=graphs)  # fmt: skip
        eng = DynamicInferenceEngine(model, None, cfg)
        row = profile_decode(eng, batch, steps, ctx.cuda)
        ctx.details["graphs" if graphs else "eager"] = row
        ctx.check(f"measured_steps_{'graphs' if graphs else 'eager'}", row["wall_ms_per_step"] > 0)
        eng.close()
    if ctx.cuda:
        ctx.check("graphs_replayed", ctx.details["graphs"]["decode_graph_replays"] > 0)


def profile_decode(eng: Any, batch: int, steps: int, cuda: bool) -> dict[str, Any]:
    """Wall ms per decode step, then the same steps under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rollout.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=1.0, num_tokens_to_generate=4 * steps + 8, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(None, torch.randint(3, 500, (64,), generator=g).tolist(), sp)
    for _ in range(4):  # prefill and warm-up (graph captures)
        eng.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            eng.step()
        sync()
    events = prof.events()
    kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
    device_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps if kernels else 0.0
    watched = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
               "cudaGraphLaunch", "aten::_local_scalar_dense")  # fmt: skip
    syncs = [e for e in events if e.name in watched]
    averages = prof.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total")[: 1 + cuda]:
        print(averages.table(sort_by=key, row_limit=15), flush=True)
    stats = eng.stats()
    return {"wall_ms_per_step": wall_ms, "device_busy_ms_per_step": device_ms,
            "kernels_per_step": len(kernels) / steps, "tokens_per_s": batch * 1e3 / wall_ms,
            "calls_per_step": {n: sum(e.name == n for e in syncs) / steps
                               for n in sorted({e.name for e in syncs})},
            "decode_graph_replays": stats.get("decode_graph_replays", 0),
            "decode_graph_captures": stats.get("decode_graph_captures", 0)}  # fmt: skip
