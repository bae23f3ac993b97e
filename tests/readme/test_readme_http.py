"""README: "OpenAI-compatible HTTP" and "RL frameworks on `rollout serve`": the serve lines, the
curl line, the openai block and each framework's config line."""

from __future__ import annotations

import json
import re
import shlex

import httpx
import pytest
from readme_helpers import (
    README,
    Proc,
    argv_of,
    exec_snippet,
    readme_command,
    run,
)


def test_http_section():
    """The HTTP section as written: serve with --http-port, the curl line, the openai block
    (DIR -> tiny, port 8000 -> a free one)."""
    serve_cmd = readme_command("test_http_section", "rollout serve")
    argv, env = argv_of(serve_cmd, DIR="tiny", **{"8000": "0"})
    with Proc(argv, env) as serve:
        url = serve.read_until(r"^http (http://\S+)")[1]
        port = url.rsplit(":", 1)[1]
        curl = shlex.split(readme_command("test_http_section", "curl").replace("8000", port)
                           .replace('"DIR"', '"tiny"'))  # fmt: skip
        body = json.loads(run(curl, env).stdout)
        choice = body["choices"][0]
        assert len(choice["token_ids"]) == 8 and choice["weight_versions"] == [0] * 8
        assert choice["logprobs"]["token_logprobs"] == choice["token_logprobs"]
        ns = exec_snippet("### OpenAI-compatible HTTP", {},
                          **{"8000": port, '"DIR"': '"tiny"'})  # fmt: skip
        assert ns["choice"].token_ids == choice["token_ids"]  # same seed, same tokens
        assert serve.stop() == 0


RL_FRAMEWORKS = "### RL frameworks on `rollout serve`: SkyRL, AReaL, prime-rl, slime"


def section_text_blocks(heading: str) -> list[str]:
    """The ```text blocks of the README section under `heading` (up to the next ### heading)."""
    section = README.split(heading, 1)[1].split("\n### ", 1)[0]
    return [b.strip() for b in re.findall(r"```text\n(.*?)```", section, re.S)]


@pytest.mark.timeout(300)
def test_rl_frameworks_section():
    """The RL frameworks section as written: the serve line, then each framework's config line
    (HOST:8000 -> the server) drives that framework's first calls."""
    serve_cmd = readme_command("test_rl_frameworks_section", "rollout serve")
    argv, env = argv_of(serve_cmd, DIR="tiny", **{"8000": "0"})
    skyrl, skyrl_delta, areal, prime, slime = section_text_blocks(RL_FRAMEWORKS)
    assert (
        "weight_sync_backend=delta" in skyrl_delta
    )  # its routes: tests/test_skyrl_delta_routes.py
    with Proc(argv, env) as serve:
        url = serve.read_until(r"^http (http://\S+)")[1]
        hostport = url.removeprefix("http://")
        with httpx.Client(timeout=60) as h:
            # SkyRL: the data plane at external_proxy_url, the control plane at each server url
            skyrl = skyrl.replace("HOST:8000", hostport)
            proxy = re.search(r"external_proxy_url=(\S+)", skyrl)[1]
            servers = re.search(r"external_server_urls=\[(\S+)\]", skyrl)[1].split(",")
            assert "run_engines_locally=false" in skyrl
            assert h.get(f"{servers[0]}/get_world_size").json() == {"world_size": 1}
            # sampled (default temperature): ignore_eos, or an early EOS shortens it
            gen = h.post(f"{proxy}/inference/v1/generate", json={
                "token_ids": [1, 2], "cache_salt": "0",
                "sampling_params": {"max_tokens": 3, "logprobs": 0,
                                    "ignore_eos": True}}).json()  # fmt: skip
            assert gen["choices"][0]["weight_versions"] == [0] * 3
            # AReaL: the env var names host:port; its vLLM backend's generation request
            addr = re.fullmatch(
                r"AREAL_LLM_SERVER_ADDRS=(\S+)", areal.replace("HOST:8000", hostport)
            )[1]
            out = h.post(f"http://{addr}/v1/completions", json={
                "prompt": [1, 2], "max_tokens": 3, "return_tokens_as_token_ids": True,
                "logprobs": 0, "skip_special_tokens": True, "ignore_eos": True}).json()  # fmt: skip
            assert [t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"]] == [
                True
            ] * 3
            # prime-rl: admin routes at base_url without /v1
            base = re.search(r'base_url=\["(\S+?)"\]', prime.replace("HOST:8000", hostport))[1]
            admin = base.removesuffix("/v1")
            assert (
                h.post(
                    f"{admin}/pause", params={"mode": "keep", "clear_cache": "false"}
                ).status_code
                == 200
            )
            assert h.post(f"{admin}/resume").status_code == 200
            # slime: the external engine's start-up probes
            engine = re.fullmatch(r"--rollout-external-engine-addrs (\S+)",
                                  slime.replace("HOST:8000", hostport))[1]  # fmt: skip
            assert h.get(f"http://{engine}/health_generate").status_code == 200
            assert h.get(f"http://{engine}/get_server_info").json()["dp_size"] == 1
        assert serve.stop() == 0
