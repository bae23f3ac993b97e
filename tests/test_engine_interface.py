"""The engine contract: every engine implements every EngineProtocol member, with parameters a
caller of the protocol can pass (a structural check, not only isinstance). Instances of the real
engine and the fake are checked whole; ClusterEngine (it needs a cluster) by its methods."""

from __future__ import annotations

import inspect

import pytest
from fake_engine import FakeEngine
from reference import tiny_model

from rollout.engine import DynamicInferenceEngine, EngineProtocol, InferenceConfig
from rollout.serving.cluster_engine import ClusterEngine
from rollout.tokenizers import ByteTokenizer

ATTRIBUTES = sorted(EngineProtocol.__annotations__)
METHODS = sorted(
    name
    for name, value in vars(EngineProtocol).items()
    if inspect.isfunction(value) and not name.startswith("_")
)


def real_engine() -> DynamicInferenceEngine:
    return DynamicInferenceEngine(
        tiny_model(seed=0), ByteTokenizer(), InferenceConfig(num_blocks=8)
    )


ENGINES = {"real": real_engine, "fake": FakeEngine}


def test_the_protocol_names_its_members():
    assert ATTRIBUTES == ["model", "tokenizer", "weight_version"]
    assert {"add_request", "step", "wake", "close", "update_weights", "discard"} <= set(METHODS)


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_engine_instance_satisfies_the_protocol(kind):
    engine = ENGINES[kind]()
    assert isinstance(engine, EngineProtocol)
    for name in ATTRIBUTES:
        assert hasattr(engine, name), f"{kind} engine lacks attribute {name}"


@pytest.mark.parametrize("cls", [DynamicInferenceEngine, FakeEngine, ClusterEngine])
def test_engine_methods_take_the_protocols_parameters(cls):
    """Every protocol method exists, accepts each protocol parameter by name (optional where
    the protocol's is) and requires nothing the protocol does not pass."""
    for name in METHODS:
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks method {name}"
        wanted = [p for p in inspect.signature(getattr(EngineProtocol, name)).parameters.values()
                  if p.name != "self"]  # fmt: skip
        have = dict(inspect.signature(impl).parameters)
        have.pop("self", None)
        for p in wanted:
            assert p.name in have, f"{cls.__name__}.{name}() takes no {p.name!r}"
            if p.default is not inspect.Parameter.empty:
                assert have[p.name].default is not inspect.Parameter.empty, (
                    f"{cls.__name__}.{name}() requires {p.name!r}, optional in the protocol"
                )
        required = {n for n, q in have.items() if q.default is inspect.Parameter.empty
                    and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)}  # fmt: skip
        extra = required - {p.name for p in wanted}
        assert not extra, f"{cls.__name__}.{name}() requires {extra}"


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_wake_is_harmless_and_close_is_final(kind):
    engine = ENGINES[kind]()
    engine.add_request(1, [1, 2, 3])
    engine.wake()
    engine.close()
    engine.close()  # idempotent
    assert not engine.has_unfinished_requests()


def test_closing_the_real_engine_frees_its_pool():
    engine = real_engine()
    engine.add_request(1, [1, 2, 3])
    engine.suspend("offload")
    engine.close()
    assert engine.kv.cache is None and engine.kv.backup is None
    assert engine.blocks.num_used == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
    with pytest.raises(RuntimeError, match="closed"):
        engine.resume()
