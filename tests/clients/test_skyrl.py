"""SkyRL's own `RemoteInferenceClient` (generator.inference_engine.run_engines_locally=false)
pointed at `rollout serve`: it generates (token ids in and out, log-probs, session ids, cache
salt), pauses around a folder weight update and resumes, sleeps and wakes, resets the prefix
cache and reads the world size; the answers are the served weights' own (<= 1e-5 against a
plain forward) and the version moved. SkyRL sends no bearer token, so the server has none."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import httpx
import pytest
import torch
from http_serve import serve_http
from reference import tiny_model

from rollout.models.loader import save_pretrained

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

skyrl = pytest.importorskip("skyrl")
# skyrl.backends/__init__ imports its Tinker API, which needs Python >= 3.12 (a TypedDict pydantic
# refuses on 3.11); the inference client itself does not: load its package without that __init__
_pkg = types.ModuleType("skyrl.backends")
_pkg.__path__ = [str(Path(skyrl.__file__).parent / "backends")]
sys.modules.setdefault("skyrl.backends", _pkg)
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (  # noqa: E402
    RemoteInferenceClient,
)


@torch.no_grad()
def _reference(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their raw log-probs from a plain forward per token."""
    seq, lps = list(prompt), []
    for _ in range(n):
        logp = torch.log_softmax(model(torch.tensor([seq])).float()[0, -1], -1)
        tok = int(logp.argmax())
        seq.append(tok)
        lps.append(float(logp[tok]))
    return seq[len(prompt) :], lps


def _check(out: dict, model: torch.nn.Module, prompts: list[list[int]], n: int) -> None:
    for prompt, ids, lps in zip(
        prompts, out["response_ids"], out["response_logprobs"], strict=True
    ):
        ref_ids, ref_lps = _reference(model, prompt, n)
        assert ids == ref_ids
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5)


def test_remote_inference_client_drives_rollout_serve(tmp_path):
    served = serve_http(tmp_path, "--block-size", "4", bearer=False)
    try:
        url = served.url
        client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1,
                                       model_name="tiny")  # fmt: skip
        prompts = [[5, 6, 7], [9, 9, 2, 4]]
        sampling = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0, "min_tokens": 0,
                    "skip_special_tokens": True, "min_p": 0.0, "top_k": -1}  # fmt: skip
        folder = tmp_path / "step_1"
        new = tiny_model(seed=41)
        save_pretrained(new, new.config, folder)

        async def run() -> dict:
            out: dict = {}
            out["world"] = await client.get_world_size()
            out["v0"] = await client.generate({"prompt_token_ids": prompts,
                                               "sampling_params": sampling,
                                               "session_ids": ["a", "b"],
                                               "cache_salt": str(client.weight_version)})  # fmt: skip
            # non-colocated sync: pause(keep) -> weights -> resume, then the version moves
            await client.pause(mode="keep")
            async with httpx.AsyncClient(base_url=url, timeout=120) as h:
                r = await h.post("/update_weights", json={"weight_dir": str(folder)})
                assert r.status_code == 200, r.text
                out["version"] = r.json()["weight_version"]
            await client.resume()
            client.increment_weight_version()
            out["v1"] = await client.generate({"prompt_token_ids": prompts,
                                               "sampling_params": sampling,
                                               "cache_salt": str(client.weight_version)})  # fmt: skip
            # colocated sync: sleep -> wake weights -> wake KV; and a cache reset
            await client.sleep(level=2)  # the weights are discarded: the same folder again
            await client.wake_up(tags=["weights"])
            async with httpx.AsyncClient(base_url=url, timeout=120) as h:
                r = await h.post("/update_weights", json={"weight_dir": str(folder)})
                assert r.status_code == 200, r.text
            await client.wake_up(tags=["kv_cache"])
            await client.reset_prefix_cache(reset_running_requests=True)
            await client.pause(mode="abort")
            await client.resume()
            out["v1b"] = await client.generate({"prompt_token_ids": prompts,
                                                "sampling_params": sampling})  # fmt: skip
            await client.teardown()
            return out

        out = asyncio.run(run())
        assert out["world"] == (1, 1)
        assert out["version"] == 1
        _check(out["v0"], tiny_model(seed=0), prompts, 6)
        _check(out["v1"], new, prompts, 6)
        assert out["v1b"]["response_ids"] == out["v1"]["response_ids"]
        assert out["v0"]["stop_reasons"] == ["length", "length"]
    finally:
        served.stop()
