"""AReaL's own `RemotevLLMEngine` (RemoteInfEngine with its vLLM backend; AREAL_LLM_SERVER_ADDRS
or `initialize(addr=...)`) against `rollout serve`: `agenerate` runs across a weight update from
disk. AReaL's interruptible generation: `pause_generation` (/areal_pause_generation) aborts the
request in flight, the client re-sends prompt + tokens so far, which the server holds until
`continue_generation`; the update (/areal_update_weights, after the trainer's name_resolve
signal, as AReaL's trainer writes it) lands in between. No token is lost or duplicated, every
token and log-prob is the weights' own that sampled it (<= 1e-5 against a plain forward), and
the version moved.

areal 1.0.4 pins torch<2.11, so it is not in the `clients` extra (torch is pinned to 2.13
here): install it with --no-deps plus the few modules its client imports (README, "AReaL")."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
import torch
from http_serve import serve_http
from reference import tiny_model

from rollout.models.loader import save_pretrained

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

pytest.importorskip("areal")
from areal.api.cli_args import (  # noqa: E402
    GenerationHyperparameters,
    InferenceEngineConfig,
    NameResolveConfig,
)
from areal.api.io_struct import ModelRequest, WeightUpdateMeta  # noqa: E402
from areal.engine.vllm_remote import RemotevLLMEngine  # noqa: E402
from areal.utils import name_resolve, names  # noqa: E402

PROMPT = [5, 6, 7]
N = 256  # long enough that the pause lands mid-generation


@torch.no_grad()
def _greedy(model: torch.nn.Module, seq: list[int], n: int) -> tuple[list[int], list[float]]:
    seq, out, lps = list(seq), [], []
    for _ in range(n):
        logp = torch.log_softmax(model(torch.tensor([seq])).float()[0, -1], -1)
        tok = int(logp.argmax())
        seq.append(tok)
        out.append(tok)
        lps.append(float(logp[tok]))
    return out, lps


def _partials(url: str) -> float:
    """Partial replies the coordinator received (one per token here: --streaming-interval 1)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(r'^rollout_coordinator_counter\{name="partials"\} (\S+)$', text, re.M)
    return float(m[1]) if m else 0.0


def test_agenerate_across_a_disk_update(tmp_path):
    served = serve_http(tmp_path, "--block-size", "4", "--streaming-interval", "1", bearer=False)
    try:
        name_resolve.reconfigure(
            NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "nr"))
        )
        config = InferenceEngineConfig(backend="vllm:d1", experiment_name="exp", trial_name="t",
                                       max_concurrent_rollouts=4, consumer_batch_size=1,
                                       request_timeout=300, pause_grace_period=0.0)  # fmt: skip
        engine = RemotevLLMEngine(config)
        engine.initialize(addr=[served.url.removeprefix("http://")])
        gconfig = GenerationHyperparameters(max_new_tokens=N, greedy=True, ignore_eos=True)
        box: dict = {}

        def generate() -> None:
            box["resp"] = asyncio.run(engine.agenerate(ModelRequest(input_ids=list(PROMPT),
                                                                    gconfig=gconfig)))  # fmt: skip

        before = _partials(served.url)
        worker = threading.Thread(target=generate)
        worker.start()
        deadline = time.monotonic() + 120
        while _partials(served.url) <= before:  # its first tokens exist
            assert time.monotonic() < deadline, "the request never generated"
            time.sleep(0.01)
        engine.pause_generation()  # aborts it; AReaL re-sends, the server holds that
        new = tiny_model(seed=51)
        folder = tmp_path / "weight_update"
        save_pretrained(new, new.config, folder)
        name_resolve.add(
            names.update_weights_from_disk("exp", "t", engine.get_version()), str(time.time())
        )  # what AReaL's trainer writes once saved
        meta = WeightUpdateMeta(type="disk", path=str(folder), clear_checkpoint_after_load=False)
        engine.update_weights_from_disk(meta).result(120)
        engine.set_version(1)
        engine.continue_generation()
        worker.join(300)
        resp = box["resp"]
        engine.destroy()
        assert httpx.get(f"{served.url}/get_weight_version").json() == {"weight_version": "1"}
    finally:
        served.stop()
    tokens, lps, versions = resp.output_tokens, resp.output_logprobs, resp.output_versions
    assert len(tokens) == N and resp.stop_reason == "length"
    k = versions.count(0)  # tokens before the abort, stamped with the old version
    assert 0 < k < N and versions == [0] * k + [1] * (N - k)
    old_tokens, old_lps = _greedy(tiny_model(seed=0), PROMPT, k)
    new_tokens, new_lps = _greedy(new, PROMPT + old_tokens, N - k)
    assert tokens == old_tokens + new_tokens
    assert torch.allclose(torch.tensor(lps), torch.tensor(old_lps + new_lps), atol=1e-5)
