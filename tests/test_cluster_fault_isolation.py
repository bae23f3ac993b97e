"""The real engine worker path: a dp=2 cluster (coordinator + two engine processes) serving a
model whose vocabulary is larger than its tokenizer's. Results holding ids the tokenizer cannot
decode killed every engine they reached (finding 2); now they come back as U+FFFD text next to
the healthy ones, and no engine dies or restarts."""

from __future__ import annotations

import pytest
from near_tie import assert_greedy_agrees
from test_engine_fault_isolation import padded_model

from rollout import LLM, InferenceConfig, SamplingParams
from rollout.tokenizers import ByteTokenizer

pytestmark = pytest.mark.timeout(300)

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=8, ignore_eos=True)
PROMPTS = [[1, 2, 3], [40, 41, 42, 43, 44], [7] * 19, [100, 90, 80, 70], [5, 6], "hello", "ok?"]


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_undecodable_results_leave_every_engine_serving():
    model = padded_model()
    cfg = InferenceConfig(num_blocks=64, max_requests=8)
    # top-2 log-probs: the cluster batches otherwise, so its greedy tokens agree with these up to
    # the first near tie (tests/near_tie.py)
    direct = LLM(model, ByteTokenizer(), cfg).generate(PROMPTS, SP.replace(top_n_logprobs=2))
    expected = [r.generated_tokens for r in direct]
    poisoned = [i for i, ids in enumerate(expected) if 299 in ids]
    assert poisoned and len(poisoned) < len(PROMPTS), "need poison mixed with healthy requests"

    llm = LLM(model, ByteTokenizer(), cfg, use_coordinator=True, data_parallel_size=2)
    try:
        pids = [p.pid for p in llm.cluster.engine_processes]
        for _ in range(2):  # every engine meets the poison (a dead one would be replaced)
            out = llm.generate(PROMPTS, SP)
            assert_greedy_agrees([r.generated_tokens for r in out], direct)
            for r in out:
                assert r.generated_text == ByteTokenizer().decode(r.generated_tokens)
                assert ("\ufffd" in r.generated_text) or 299 not in r.generated_tokens
        assert all(p.is_alive() for p in llm.cluster.engine_processes)
        assert [p.pid for p in llm.cluster.engine_processes] == pids
        assert llm.cluster.supervision_stats()["restarts"] == 0
        assert len(llm.cluster.stats()["engines"]) == 2
    finally:
        llm.shutdown()
