"""guidellm, as shipped, benchmarking `rollout serve` with its defaults (chat completions,
streamed, `stream_options.continuous_usage_stats`) at concurrency 1 to 4: every request
succeeds, and its token counts equal the server's (per request: the prompt as the server
tokenizes it and max_tokens generated; in total: the server's /metrics counters)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from http_checkpoint import make_checkpoint, serve
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

pytest.importorskip("guidellm")

PER_LEVEL = 8
OUTPUT_TOKENS = 8


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in ("rollout_http_prompt_tokens_total", "rollout_http_generated_tokens_total")}  # fmt: skip


def test_guidellm_streams_at_concurrency_1_to_4_with_the_servers_counts(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "benchmarks.json"
    with serve(ckpt) as url:
        before = _counters(url)
        cmd = [sys.executable, "-m", "guidellm", "run",
               "--backend", f"kind=openai_http,target={url},model={ckpt}",
               "--profile", "kind=concurrent,streams=1", "--override", "profile.streams", "1,2,3,4",
               "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
               "--tokenizer", f"kind=huggingface_auto,model={ckpt}",
               "--constraint", f"kind=max_requests,count={PER_LEVEL}",
               "--output", f"kind=json,path={out}", "--disable-console"]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=800, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        after = _counters(url)
        benchmarks = json.loads(out.read_text())["benchmarks"]
        assert [b["config"]["strategy"]["streams"] for b in benchmarks] == [1, 2, 3, 4]
        prompt_total = generated_total = 0
        for b in benchmarks:
            reqs = b["requests"]
            assert not reqs["errored"] and not reqs["incomplete"]
            assert len(reqs["successful"]) == PER_LEVEL
            for r in reqs["successful"]:
                body = json.loads(r["request_args"])["body"]
                assert body["stream"] and body["stream_options"]["continuous_usage_stats"]
                tokens = httpx.post(f"{url}/tokenize", json={"messages": body["messages"]},
                                    timeout=30).json()["count"]  # fmt: skip
                assert r["input_metrics"]["text_tokens"] == tokens
                assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
                prompt_total += tokens
                generated_total += OUTPUT_TOKENS
        assert after["rollout_http_prompt_tokens_total"] - before["rollout_http_prompt_tokens_total"] == prompt_total  # fmt: skip
        assert after["rollout_http_generated_tokens_total"] - before["rollout_http_generated_tokens_total"] == generated_total  # fmt: skip
