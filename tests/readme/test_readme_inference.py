"""README: "As an inference library": `rollout serve`'s synopsis and the python block."""

from __future__ import annotations

import asyncio

import pytest
from readme_helpers import (
    Proc,
    argv_of,
    exec_snippet,
    make_checkpoint,
    peer_token,
    readme_command,
    serve_requests,
)


@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_serve_synopsis():
    """`rollout serve --model tiny --dp 2 --port P --policy NAME` serves an InferenceClient."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    command = readme_command("test_serve_synopsis").replace("[", "").replace("]", "")
    argv, env = argv_of(
        command, **{"DIR|tiny": "tiny", "N": "2", "P": port, "NAME": "longest_prefix"}
    )
    with Proc(argv, env) as serve:
        address = serve.read_until(r"coordinator (tcp://\S+) pid")[1]
        assert address.endswith(f":{port}")
        serve.read_until(r"^ready: 2 engine")
        token = peer_token(serve, argv, env)
        assert asyncio.run(serve_requests(address, token, engines=2)) == 24
        assert serve.stop() == 0


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_inference_snippet(tmp_path):
    """The inference library: a saved checkpoint, direct generate, then 2 engine processes
    behind the coordinator through the acknowledged lifecycle and a weight update."""
    from rollout.models import load_pretrained

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", bos=True)
    new_model, _ = load_pretrained(ckpt)
    ns = exec_snippet("### As an inference library", {"new_model": new_model},
                      **{"path/to/hf_checkpoint": str(ckpt)})  # fmt: skip
    assert len(ns["out"]) == 2
