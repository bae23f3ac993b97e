"""Staged weight updates (rollout.engine.staging): the next version is received and checked
while the engine decodes on the current one, then flips between two steps.

The model here writes its weights' version into its output: every forward reads a stamp from the
first weight it uses (the embedding) and, at its end, a `marker` parameter; both hold the
version, and the logits put all mass on token 10 + version when they agree (MIXED otherwise).
So a token whose recorded version is not its logits' version, or a forward that read two
versions, shows in the tokens themselves.
"""

from __future__ import annotations

import threading

import pytest
import torch
from fake_engine import wait_for
from torch import nn

from rollout.engine import DynamicInferenceEngine, InferenceConfig
from rollout.engine.staging import StagingAborted
from rollout.models import ModelConfig, build_model
from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams
from rollout.tokenizers import ByteTokenizer

pytestmark = pytest.mark.timeout(120)

VOCAB = ByteTokenizer().vocab_size
BASE, MIXED = 10, 5  # token of version v: BASE + v; a forward that read two versions: MIXED


def marker_model() -> nn.Module:
    model = build_model(ModelConfig.preset("tiny", vocab_size=VOCAB), seed=0)
    model.register_parameter("marker", nn.Parameter(torch.zeros(())))
    stamp_param = next(iter(model.parameters()))  # the embedding: read first in a forward
    seen: dict[str, float] = {}
    forward, compute_logits = model.forward_paged, model.compute_logits

    def stamped_forward(*args, **kwargs):
        seen["stamp"] = float(stamp_param.reshape(-1)[0])
        return forward(*args, **kwargs)

    def version_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        version = float(model.marker.detach())
        token = BASE + int(version) if seen["stamp"] == version else MIXED
        out = torch.full_like(logits, -1e4)
        out[:, token] = 0.0
        return out

    model.forward_paged, model.compute_logits = stamped_forward, version_logits
    return model


def weights_of(model: nn.Module, version: int) -> dict[str, torch.Tensor]:
    sd = {k: t.detach().clone() for k, t in model.state_dict().items()}
    first = next(iter(sd))
    sd[first].view(-1)[0] = float(version)
    sd["marker"] = torch.tensor(float(version))
    return sd


def engine(weight_update: str = "staged") -> tuple[DynamicInferenceEngine, nn.Module]:
    model = marker_model()
    cfg = InferenceConfig(block_size=4, num_blocks=128, max_requests=8, max_tokens_per_step=64,
                          max_sequence_length=128, kv_policy="keep",
                          weight_update=weight_update)  # fmt: skip
    eng = DynamicInferenceEngine(model, ByteTokenizer(), cfg)
    with torch.no_grad():  # version 0's stamp and marker
        model.marker.zero_()
        next(iter(model.parameters())).view(-1)[0] = 0.0
    return eng, model


SP = SamplingParams(num_tokens_to_generate=100, ignore_eos=True, seed=1)


def _tokens_match_versions(req) -> None:
    tokens = list(req.generated_tokens)
    assert MIXED not in tokens
    assert [t - BASE for t in tokens] == req.generated_weight_versions


def test_config_refuses_unknown_weight_update():
    with pytest.raises(ValueError, match="weight_update"):
        InferenceConfig(weight_update="swap")


def test_staging_runs_while_the_engine_decodes_and_the_flip_is_between_two_steps():
    """Staging (gated so that it cannot finish before the engine stepped 3 times) runs while
    the engine decodes on version 0; after the flip, the very next step samples version 1. No
    step with requests pending goes without a token (the stall is the flip, between steps)."""
    eng, model = engine()
    for i in range(3):
        eng.add_request(None, [256, 1 + i, 2, 3], SP)
    eng.step()  # prefill
    steps = {"n": 0}
    done = threading.Event()
    result: dict = {}

    def gate() -> bool:  # called between tensors: hold staging until the engine stepped on
        if steps["n"] < 3:
            wait_for(lambda: steps["n"] >= 3, 60, "engine steps while staging")
        return False

    def stage() -> None:
        try:
            result["staged"] = eng.stage_weights(weights_of(model, 1), 1, should_abort=gate)
        finally:
            done.set()

    with eng.weight_stage.hold():
        threading.Thread(target=stage, daemon=True).start()
        empty = 0
        while not done.is_set():
            before = eng.counters["tokens_generated"]
            eng.step()
            steps["n"] += 1
            empty += eng.counters["tokens_generated"] == before
        assert eng.weight_version == 0 and steps["n"] >= 3
        eng.flip_weights(result["staged"])
        before = eng.counters["tokens_generated"]
        eng.step()
        empty += eng.counters["tokens_generated"] == before
    assert empty == 0
    reqs = [seq.record.merge() for seq in eng._seqs.values()]
    for req in reqs:
        versions = req.generated_weight_versions
        assert versions[-1] == 1 and versions.count(0) >= 4  # steps ran on 0 while staging
        _tokens_match_versions(req)


def test_a_refused_or_aborted_stage_leaves_the_current_version_serving():
    eng, model = engine()
    rid = eng.add_request(None, [256, 7, 8], SP).request_id
    eng.step()
    bad = weights_of(model, 1)
    bad["marker"] = torch.zeros(2)
    with eng.weight_stage.hold(), pytest.raises(ValueError, match="marker"):
        eng.stage_weights(bad, 1)
    assert eng.weight_stage.staged is None
    calls = iter(range(1000))
    with eng.weight_stage.hold():
        with pytest.raises(StagingAborted):  # the buffer is half written when it gives up
            eng.stage_weights(weights_of(model, 1), 1, should_abort=lambda: next(calls) == 3)
        assert eng.weight_stage.staged is None
        eng.step()
    with eng.weight_stage.hold():
        staged = eng.stage_weights(weights_of(model, 1), 1)
    with pytest.raises(ValueError, match="not the one staged"):  # held no more: not flippable
        eng.flip_weights(staged)
    assert eng.weight_version == 0
    eng.step()
    req = eng._seqs[rid].record.merge()
    assert set(req.generated_weight_versions) == {0}
    _tokens_match_versions(req)
    with eng.weight_stage.hold():  # a later stage still goes through
        eng.flip_weights(eng.stage_weights(weights_of(model, 2), 2))
    eng.step()
    req = eng._seqs[rid].record.merge()
    assert req.generated_weight_versions[-1] == 2
    _tokens_match_versions(req)


def _prompts():
    for i in range(10_000):
        sp = SamplingParams(num_tokens_to_generate=(12, 40)[i % 2], ignore_eos=True, seed=i)
        yield {"prompt": [256, 1 + i % 250, 1 + i // 250, 9], "sampling_params": sp}


@pytest.mark.parametrize("weight_update", ["staged", "pause"])
def test_async_updates_from_another_thread_never_mix_versions(weight_update):
    """Async manager: a trainer thread pushes 6 versions while generation runs; every token
    is the one its recorded version's weights produce, and samples cross versions."""
    eng, model = engine(weight_update)
    versions = [weights_of(model, v) for v in range(1, 7)]
    with RolloutManager(engine=eng, mode="async", max_inflight_groups=6,
                        collect_timeout_s=60.0) as m:  # fmt: skip
        errors: list = []

        def trainer() -> None:
            try:
                for v, sd in enumerate(versions, 1):
                    seen = eng.counters["tokens_generated"]
                    wait_for(lambda s=seen: eng.counters["tokens_generated"] > s + 3, 60, "tokens")
                    m.update_weights(sd, v)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        t = threading.Thread(target=trainer, daemon=True)
        t.start()
        source, got = _prompts(), []
        while t.is_alive() or len(got) < 8:
            got += m.collect(source, 2)
        t.join(60)
        stats = m.stats()
    assert not errors, errors
    assert stats["rollout/version"] == 6
    crossed = 0
    for s in got:
        assert not s.failed, s.error
        assert MIXED not in s.completion_tokens
        assert [t - BASE for t in s.completion_tokens] == s.token_versions
        crossed += len(set(s.token_versions)) > 1
    assert crossed >= 1
    if weight_update == "staged":
        assert "weight_sync/staging_seconds" in stats


def test_manager_refuses_a_bad_staged_update_and_keeps_serving():
    eng, model = engine()
    with RolloutManager(engine=eng, mode="async", max_inflight_groups=2,
                        collect_timeout_s=60.0) as m:  # fmt: skip
        bad = weights_of(model, 1)
        del bad["marker"]
        with pytest.raises(ValueError, match="marker"):
            m.update_weights(bad)
        assert m.version == 0 and eng.weight_version == 0
        source = _prompts()
        got = m.collect(source, 2)
        m.update_weights(weights_of(model, 1))
        got += m.collect(source, 2) + m.collect(source, 2)  # the last: submitted after it
    assert got[0].token_versions[0] == 0 and set(got[-1].token_versions) == {1}
    for s in got:
        assert [t - BASE for t in s.completion_tokens] == s.token_versions


def gated_engine(**kwargs):
    """Worker-process factory: an engine whose staging starts only once the engine stepped
    twice more, and raises when it does not within 60 s (a loop blocked by the transfer)."""
    from rollout.serving import factory

    eng = factory.build_engine(**kwargs)
    stage = eng.stage_weights

    def gated(state_dict, version, should_abort=None):
        start = eng.counters["steps"]
        wait_for(lambda: eng.counters["steps"] >= start + 2, 60, "engine steps while staging")
        return stage(state_dict, version, should_abort)

    eng.stage_weights = gated
    return eng


@pytest.mark.heavy  # two engine processes, 1,000+ tokens: ~14 s; .ci/run runs it
def test_engine_processes_step_while_they_receive_a_staged_update():
    """dp = 2, async: each engine process receives and stages while its loop keeps stepping
    (its staging waits for two more steps: an engine that stopped would fail the update), and
    the version reaches every engine with the trainer's digest check."""
    icfg = {"block_size": 4, "num_blocks": 256, "max_requests": 8, "max_tokens_per_step": 64,
            "max_sequence_length": 256, "weight_update": "staged"}  # fmt: skip
    options = {"engine_factory": gated_engine,
               "coordinator": {"policy": "round_robin", "heartbeat_s": 0.2}}  # fmt: skip
    sd = build_model(ModelConfig.preset("tiny", vocab_size=VOCAB), seed=5).state_dict()

    def prompts():
        for i in range(10_000):
            sp = SamplingParams(num_tokens_to_generate=2 if i == 0 else 200, ignore_eos=True)
            yield {"prompt": [256, 1 + i % 250, 9], "sampling_params": sp}

    with RolloutManager(model="tiny", tokenizer=None, dp=2, inference_config=icfg,
                        cluster_options=options, mode="async", max_inflight_groups=5,
                        collect_timeout_s=120.0) as m:  # fmt: skip
        source = prompts()
        first = m.collect(source, 1)  # the others, long, keep both engines busy
        assert m.update_weights(sd) == 1
        acks = m.engine.last_sync
        rest = m.collect(source, 4)
    assert first[0].token_versions == [0, 0]
    assert sorted(acks) == [0, 1] and all(a["weight_version"] == 1 for a in acks.values())
    assert any(set(s.token_versions) == {0, 1} for s in rest)


def test_staged_update_benchmark_runs(tmp_path):
    """benchmarks/staged_update.py --quick: both modes reach every version, side by side."""
    from benchmarks.staged_update import main

    result = main(quick=True, out_dir=tmp_path)
    for mode in ("pause", "staged"):
        r = result[mode]
        assert r["version"] == result["shape"]["updates"] and r["median_step_s"] > 0
        assert r["longest_gap_during_update_s"] >= r["stall_s"] >= 0
    assert result["staged"]["staging_seconds"] is not None
    assert result["ratios"]["stall_pause_over_staged"] > 0
    assert (tmp_path / "staged_update.json").exists()
    assert (tmp_path / "staged_update.png").stat().st_size > 0


def test_the_copy_flip_keeps_the_weights_addresses():
    """Under CUDA graphs (which hold the weights' addresses) the flip copies instead of
    swapping storage: same addresses, the staged values, tied names flipped once."""
    eng, model = engine()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    with eng.weight_stage.hold():
        staged = eng.stage_weights(weights_of(model, 1), 1)
        eng.weight_stage.flip(staged, swap=False)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    want = weights_of(model, 1)
    for name, t in model.state_dict().items():
        assert torch.equal(t, want[name]), name
    with eng.weight_stage.hold():  # the swap: the buffer's storage becomes the weights'
        staged = eng.stage_weights(weights_of(model, 2), 2)
        eng.weight_stage.flip(staged, swap=True)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} != ptrs
    assert float(model.marker.detach()) == 2.0
