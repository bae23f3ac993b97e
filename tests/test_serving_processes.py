"""rollout.serving: the background event loop, model sources, and clusters that never leave a
process behind (parent raises, parent SIGKILLed)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from rollout.serving.event_loop import EventLoopManager
from rollout.serving.factory import model_source_kwargs

pytestmark = pytest.mark.timeout(120)


def test_event_loop_manager_bridges_sync_and_async_callers():
    mgr = EventLoopManager()
    with pytest.raises(RuntimeError, match="not started"):
        _ = mgr.loop
    assert mgr.start() is mgr and mgr.start() is mgr  # idempotent
    loop = mgr.loop

    async def where() -> asyncio.AbstractEventLoop:
        await asyncio.sleep(0)
        return asyncio.get_running_loop()

    assert mgr.run_sync(where()) is loop
    assert mgr.submit(where()).result(5) is loop
    assert asyncio.run(mgr.run_async(where())) is loop  # awaited from another loop

    async def nested() -> None:
        mgr.run_sync(where())

    with pytest.raises(RuntimeError, match="own thread"):
        mgr.run_sync(nested())

    async def slow() -> None:
        await asyncio.sleep(30)

    with pytest.raises(TimeoutError, match=r"within 0\.05s"):
        mgr.run_sync(slow(), timeout=0.05)
    pending = mgr.submit(slow())
    mgr.stop()
    mgr.stop()
    assert pending.cancelled() and not mgr.running
    with pytest.raises(RuntimeError, match="not started"):
        mgr.submit(where())


def test_model_sources(tmp_path):
    from rollout.models import ModelConfig, build_model, load_pretrained

    assert model_source_kwargs("tiny", 3, None, None, lambda: tmp_path) == {
        "model": "tiny", "seed": 3, "tokenizer": "byte"}  # fmt: skip
    cfg = ModelConfig.preset("tiny", vocab_size=64)
    net = build_model(cfg, seed=1)
    kw = model_source_kwargs(net.state_dict(), 0, cfg, None, lambda: tmp_path)
    loaded, _ = load_pretrained(kw["model"])
    assert kw["tokenizer"] == "none"
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in net.state_dict().items())
    with pytest.raises(ValueError, match="neither"):
        model_source_kwargs("no/such/dir", 0, None, None, lambda: tmp_path)
    with pytest.raises(ValueError, match="model_config"):
        model_source_kwargs({"w": torch.ones(2)}, 0, None, None, lambda: tmp_path)


_SCRIPT = """
import os, signal, sys
from rollout.serving.cluster import EngineCluster

def main():
    cluster = EngineCluster(1, "tiny", weight_sync=False, inference_config={{"num_blocks": 16}})
    cluster.start()
    print(" ".join(str(p.pid) for p in cluster.processes), flush=True)
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("trainer crashed")

if __name__ == "__main__":
    main()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_no_process_left_behind_when_the_parent_raises_or_is_killed(tmp_path):
    procs = {}
    for kill in (False, True):
        script = tmp_path / f"parent_{kill}.py"
        script.write_text(textwrap.dedent(_SCRIPT.format(kill=kill)))
        procs[kill] = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    children = []
    for kill, p in procs.items():
        out, err = p.communicate(timeout=90)
        assert p.returncode == (-9 if kill else 1), err[-2000:]
        assert kill or "trainer crashed" in err
        pids = [int(x) for x in out.split()]
        assert len(pids) == 2, (out, err[-2000:])
        children += pids
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)  # orphans notice the closed lifeline and exit; bounded wait
    assert not any(_alive(p) for p in children), children
