"""The worker hands the coordinator's block hashes to the engine (a prompt is hashed once)."""

from __future__ import annotations

import pytest
from reference import tiny_model

import rollout.hashing
from rollout.engine.config import InferenceConfig
from rollout.engine.engine import DynamicInferenceEngine
from rollout.hashing import compute_block_hashes_batched
from rollout.protocol import pack_hashes, pack_obj, pack_tokens
from rollout.sampling import SamplingParams
from rollout.serving.worker import EngineWorker
from rollout.tokenizers import ByteTokenizer

SP = SamplingParams(temperature=0.0, num_tokens_to_generate=2, ignore_eos=True)
PROMPT = list(range(1, 38))  # 37 tokens: 4 complete blocks of 8; +2 generated stays in block 5


def _engine() -> DynamicInferenceEngine:
    model = tiny_model(seed=0)
    return DynamicInferenceEngine(
        model, ByteTokenizer(), InferenceConfig(block_size=8, num_blocks=32)
    )


def _finish(engine: DynamicInferenceEngine) -> list[int]:
    records = []
    while engine.has_unfinished_requests():
        records += engine.step().finished
    return records[0].merge().generated_tokens


@pytest.fixture
def hash_calls(monkeypatch):
    """Counts every chained-digest computation the engine makes (it hashes lazily)."""
    calls, real = [], rollout.hashing.chained_block_digests

    def counting(tokens, *args, **kwargs):
        calls.append(len(tokens))
        return real(tokens, *args, **kwargs)

    monkeypatch.setattr(rollout.hashing, "chained_block_digests", counting)
    return calls


@pytest.mark.parametrize("forward", [True, False])
def test_forwarded_hashes_are_used_instead_of_recomputed(hash_calls, forward):
    engine = _engine()
    worker = EngineWorker(
        engine, "tcp://127.0.0.1:9", rank=0, block_size=8
    )  # no I/O: never registers
    try:
        hashes = compute_block_hashes_batched(PROMPT, 8)
        hash_calls.clear()
        packed = pack_hashes(hashes) if forward else b""
        worker._add(
            [7, pack_tokens(PROMPT), pack_obj(SP.serialize()), packed, b"", b"", b"", False, b""]
        )
        generated = _finish(engine)
        assert (len(hash_calls) == 0) is forward, hash_calls
        expected = DynamicInferenceEngine.generate(_engine(), [PROMPT], SP)[0].generated_tokens
        assert generated == expected
    finally:
        worker.close()


def test_hashes_of_another_block_size_are_ignored(hash_calls):
    engine = _engine()
    worker = EngineWorker(engine, "tcp://127.0.0.1:9", rank=0, block_size=8)
    try:
        wrong = pack_hashes(compute_block_hashes_batched(PROMPT, 16))  # 2 blocks, engine wants 4
        hash_calls.clear()
        worker._add(
            [8, pack_tokens(PROMPT), pack_obj(SP.serialize()), wrong, b"", b"", b"", False, b""]
        )
        assert len(_finish(engine)) == 2
        assert hash_calls, "hashes made with another block size must not be trusted"
    finally:
        worker.close()
