"""RolloutManager (embedded engine): exact staleness against an independent timeline oracle,
on-policy fidelity against the trainer's forward, suspend memory, long-run hygiene, async mode."""

from __future__ import annotations

import bisect
import gc
import os
import time

import pytest
import torch

from rollout.config import load_config
from rollout.config.builders import build_manager, build_model_and_tokenizer
from rollout.engine.config import InferenceConfig
from rollout.models import ModelConfig, build_model
from rollout.rl.manager import RolloutManager
from rollout.rl.samples import collate
from rollout.sampling import SamplingParams

CFG = ModelConfig.preset("tiny", vocab_size=128)


def _weights(version: int) -> dict[str, torch.Tensor]:
    """Version v of the trainer's weights: a fixed base plus a version-specific perturbation."""
    torch.manual_seed(1234)
    base = build_model(CFG).state_dict()
    g = torch.Generator().manual_seed(version)
    out = {k: v + 0.05 * version * torch.randn(v.shape, generator=g) for k, v in base.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied: one tensor, one value
    return out


def _manager(kv_policy="recompute", suspend_mode="offload", **kw) -> RolloutManager:
    model = build_model(CFG)
    model.load_state_dict(_weights(0))
    icfg = InferenceConfig(
        num_blocks=128, block_size=8, max_requests=16, max_tokens_per_step=256, kv_policy=kv_policy
    )
    return RolloutManager(model=model, inference_config=icfg, suspend_mode=suspend_mode, **kw)


def _sp(n_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(num_tokens_to_generate=n_tokens, ignore_eos=True, seed=seed)


def _count_after(times: list[float], t: float) -> int:
    return len(times) - bisect.bisect_right(times, t)


def _oracle(
    sample, updates: list[float], kv_resets: list[float]
) -> tuple[list[int], list[int], list[int]]:
    """Per-token versions, policy and KV staleness from wall-clock times alone.

    A token sampled at time t has version #updates before t and policy staleness #updates after
    t. Its KV is computed when it is fed back (the step that samples the next token; the last
    token is never fed), and again at every KV reset (re-prefill) while the request is in flight.
    """
    times, finish = sample.token_times, sample.token_times[-1]
    versions = [len(updates) - _count_after(updates, t) for t in times]
    policy = [_count_after(updates, t) for t in times]
    kv = []
    for i, t in enumerate(times):
        computed = times[i + 1] if i + 1 < len(times) else t
        resets = [r for r in kv_resets if t < r < finish]
        kv.append(_count_after(updates, max([computed, *resets])))
    return versions, policy, kv


def _logprobs_under(version: int, tokens: list[int]) -> torch.Tensor:
    model = build_model(CFG)
    model.load_state_dict(_weights(version))
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lp  # lp[j] scores tokens[j + 1]


@pytest.mark.parametrize(
    "kv_policy,suspend_mode",
    [("recompute", "offload"), ("keep", "offload"), ("keep", "recompute")],
)
def test_oracle_staleness_over_five_updates(kv_policy, suspend_mode):
    lengths = [6, 12, 18, 24, 30, 36]  # a sample finishes between every two updates
    prompts = [
        {"prompt": [3 + i, 40 + i, 7], "sampling_params": _sp(n, seed=i), "length": n}
        for i, n in enumerate(lengths)
    ]
    updates: list[float] = []
    resets: list[float] = []
    got = []
    with _manager(kv_policy, suspend_mode, max_inflight_groups=len(prompts)) as m:
        source = iter(prompts)
        for step in range(len(prompts)):
            batch = m.collect(source, 1, n=1)
            assert (
                len(batch) == 1 and len(batch[0].completion_tokens) == batch[0].metadata["length"]
            )
            got.extend((b, list(updates)) for b in batch)  # staleness is as of hand-out
            if step == len(prompts) - 1:
                break
            freed = m.suspend()
            assert freed > 0
            m.update_weights(_weights(step + 1))
            updates.append(time.time())
            if kv_policy == "recompute" or suspend_mode == "recompute":
                resets.append(time.time())  # KV re-prefilled at the first step after resume
            m.resume()
        assert m.version == 5 and m.stats()["rollout/num_updates"] == 5
    longest = got[-1][0]
    assert longest.weight_versions == [0, 1, 2, 3, 4, 5]
    spans = 0
    for s, seen in got:
        versions, policy, kv = _oracle(s, seen, resets)
        assert s.token_versions == versions
        assert s.weight_versions == sorted(set(versions))
        assert s.policy_staleness == policy, (s.group_id, s.policy_staleness, policy)
        assert s.kv_staleness == kv, (s.group_id, s.kv_staleness, kv)
        spans += len(s.weight_versions) > 1
        assert s.num_evictions == 0 and s.finish_reason == "length"
    assert spans == 5  # every sample but the first is a partial rollout across updates
    if kv_policy == "keep" and suspend_mode == "offload":
        assert longest.kv_staleness != [0] * len(longest.kv_staleness)
    _check_fidelity(
        [s for s, _ in got], per_token=kv_policy == "recompute" or suspend_mode == "recompute"
    )


def _check_fidelity(samples, per_token: bool) -> None:
    """Behaviour log-probs == the trainer's log-probs with the sampling weights (fp32, 1e-5).

    Samples from one version must match exactly. When every update re-prefilled the KV
    (recompute), each token's whole context went through the version that sampled it, so every
    token must match its own version's forward too.
    """
    checked = 0
    for s in samples:
        if len(s.weight_versions) > 1 and not per_token:
            continue
        tokens = s.prompt_tokens + s.completion_tokens
        p = len(s.prompt_tokens)
        behaviour = torch.tensor(s.logprobs)
        for v in s.weight_versions:
            idx = [i for i, tv in enumerate(s.token_versions) if tv == v]
            ref = _logprobs_under(v, tokens)[[p - 1 + i for i in idx]]
            assert torch.max(torch.abs(ref - behaviour[idx])).item() <= 1e-5
            checked += len(idx)
    assert checked > 0


def test_suspend_frees_kv_pool_and_refuses_generation():
    with _manager(suspend_mode="recompute") as m:
        m.generate([[1, 2, 3]], sampling_params=_sp(4))
        pool = m.engine.kv.nbytes
        assert m.suspend() == pool > 0
        assert m.engine.kv.cache is None and m.suspended
        assert m.suspend() == 0  # idempotent
        assert m.stats()["engine/kv_bytes_freed"] == pool
        with pytest.raises(RuntimeError, match="suspended"):
            m.generate([[1, 2, 3]], sampling_params=_sp(4))
        m.resume()
        assert m.engine.kv.cache is not None
        assert len(m.generate([[1, 2, 3]], n=2, sampling_params=_sp(4))) == 2


def test_update_weights_validates_and_versions():
    with _manager() as m:
        before = {k: v.clone() for k, v in m.engine.model.state_dict().items()}
        bad = _weights(1)
        bad["model.norm.weight"] = torch.zeros(3)
        bad["bogus"] = torch.zeros(1)
        with pytest.raises(ValueError, match=r"bogus.*|model\.norm\.weight"):
            m.update_weights(bad)
        partial = _weights(1)
        partial.pop("model.norm.weight")
        with pytest.raises(ValueError, match="missing"):
            m.update_weights(partial)
        for k, v in m.engine.model.state_dict().items():
            assert torch.equal(v, before[k]), k
        assert m.update_weights(_weights(1), version=7) == 7
        with pytest.raises(ValueError, match="must increase"):
            m.update_weights(_weights(1), version=7)
        assert m.update_weights(_weights(2)) == 8 == m.engine.weight_version


def _tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            st = obj.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def test_hundred_cycles_do_not_leak_memory_or_fds():
    sds = [_weights(1), _weights(2)]
    with _manager(suspend_mode="recompute") as m:
        source = iter([[i % 100 + 1, 5] for i in range(10_000)])

        def cycle(i: int) -> None:
            m.suspend()
            m.update_weights(sds[i % 2])
            m.resume()
            if i % 25 == 0:  # keep some partial rollouts in flight through the cycles
                m.collect(source, 1, n=2, sampling_params=_sp(3))

        for i in range(10):
            cycle(i)
        mem, fds = _tensor_bytes(), len(os.listdir("/proc/self/fd"))
        for i in range(10, 100):
            cycle(i)
        assert m.version == 100
        assert _tensor_bytes() <= mem
        assert len(os.listdir("/proc/self/fd")) <= fds


def test_collate_aligns_with_tokens():
    with _manager() as m:
        samples = m.generate([[1, 2, 3], [4, 5]], n=2, sampling_params=_sp(5, seed=3))
    for s in samples:
        s.reward = float(s.index)
    b = collate(samples, pad_id=0)
    assert b["tokens"].shape == (4, 8) and b["rewards"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert [s.group_id for s in samples] == [0, 0, 1, 1]
    for i, s in enumerate(samples):
        mask = b["completion_mask"][i]
        assert b["tokens"][i][mask].tolist() == s.completion_tokens
        assert torch.allclose(b["behaviour_logp"][i][mask], torch.tensor(s.logprobs))
        assert int(b["attention_mask"][i].sum()) == s.num_tokens
    with pytest.raises(ValueError, match="at least one"):
        collate([])


def test_bad_config_and_arguments():
    with pytest.raises(ValueError, match="mode"):
        _manager(mode="sync")
    with pytest.raises(ValueError, match="stale_policy"):
        _manager(stale_policy="keep")
    with _manager() as m:
        with pytest.raises(ValueError, match="n \\(samples per prompt\\)"):
            m.generate([[1]], n=0)
        with pytest.raises(ValueError, match="batch_size_groups"):
            m.collect([[1]], 0)
        with pytest.raises(ValueError, match="no prompt"):
            m.collect([{"text": "x"}], 1)
    with pytest.raises(RuntimeError, match="closed"):
        m.generate([[1]])


def test_collect_returns_partial_batch_then_empty_when_source_ends():
    with _manager() as m:
        prompts = iter([[1, 2], [3, 4], [5, 6]])
        a = m.collect(prompts, 2, n=2, sampling_params=_sp(3), reward_fn=lambda s: 1.0)
        b = m.collect(prompts, 2, n=2, sampling_params=_sp(3))
        c = m.collect(prompts, 2, n=2, sampling_params=_sp(3))
    assert len(a) == 4 and len(b) == 2 and c == []
    assert all(s.reward == 1.0 for s in a) and b[0].reward is None
    assert sorted({s.group_id for s in a + b}) == [0, 1, 2]


def test_collect_more_groups_than_may_be_in_flight():
    """A batch larger than max_inflight_groups is collected in installments, not awaited whole."""
    with _manager(max_inflight_groups=2) as m:
        batch = m.collect(iter([[i + 1, 2] for i in range(20)]), 5, n=2, sampling_params=_sp(3))
    assert len(batch) == 10 and len({s.group_id for s in batch}) == 5


def test_a_batch_lists_its_groups_in_the_order_their_prompts_were_pulled():
    """Group 0's long prompt is prefilled in chunks, so group 1 finishes first; the batch is still
    in pull order (a rerun's batch must not depend on which engine finished first)."""
    with _manager() as m:
        prompts = iter([[1 + i % 50 for i in range(600)], [3, 4]])
        batch = m.collect(prompts, 2, n=2, sampling_params=_sp(2))
    assert [s.group_id for s in batch] == [0, 0, 1, 1] and [s.index for s in batch] == [0, 1, 0, 1]


def test_stats_describe_the_whole_batch_not_its_last_group():
    """Partial rollouts carried over an update come first, fresh groups last: the staleness
    stats must cover the whole batch handed out (a trainer logs them as the batch's)."""
    with _manager() as m:
        first = m.collect([[1, 2], [3, 4], [5, 6]], 1, n=2, sampling_params=_sp(40))
        m.update_weights(_weights(1))
        batch = m.collect([[7, 8], [9, 10]], 3, n=2, sampling_params=_sp(40))
        stats = m.stats()
    assert len(first) == 2 and len(batch) == 6
    tokens = [x for s in batch for x in s.policy_staleness]
    assert max(tokens) >= 1 and batch[-1].max_policy_staleness == 0  # mixed on purpose
    assert stats["staleness/policy_max"] == max(tokens)
    assert stats["staleness/policy_mean"] == pytest.approx(sum(tokens) / len(tokens))


# ------------------------------------------------------------------------------ async mode


def _wait_ready(m: RolloutManager, k: int) -> None:
    with m._cv:
        assert m._cv.wait_for(lambda: len(m._ready) >= k, timeout=60)


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_async_generates_in_background_and_bounds_staleness(policy):
    prompts = iter([[i % 90 + 1, 2, 3] for i in range(1000)])
    with _manager(mode="async", max_staleness=0, stale_policy=policy, max_inflight_groups=4) as m:
        first = m.collect(prompts, 1, n=2, sampling_params=_sp(4))
        assert len(first) == 2 and all(s.max_policy_staleness == 0 for s in first)
        side = m.generate([[9, 9]], n=2, sampling_params=_sp(3))  # beside the collect stream
        assert [len(s.completion_tokens) for s in side] == [3, 3]
        _wait_ready(m, 3)  # the engine kept going while the "trainer" was away
        m.update_weights(_weights(1))
        batch = m.collect(prompts, 3, n=2, sampling_params=_sp(4))
        stats = m.stats()
        assert len(batch) == 6 and all(s.max_policy_staleness == 0 for s in batch)
        assert all(s.weight_versions == [1] for s in batch)
        if policy == "drop":
            assert stats["rollout/groups_dropped_stale"] >= 3
        else:
            assert stats["rollout/samples_regenerated"] >= 6
        thread = m._driver.thread
    assert not thread.is_alive()


def test_async_update_lands_between_steps_and_close_on_exception():
    prompts = iter([{"prompt": [7, i % 90 + 1], "sampling_params": _sp(40)} for i in range(100)])
    with pytest.raises(KeyError), _manager(mode="async", max_inflight_groups=2) as m:
        m.collect(prompts, 1, n=1, sampling_params=_sp(40))
        for v in (1, 2, 3):
            m.update_weights(_weights(v))
        batch = m.collect(prompts, 2, n=1)
        for s in batch:  # versions only ever step up along a sample, never interleave
            assert s.token_versions == sorted(s.token_versions)
            assert s.policy_staleness == [sum(u > v for u in range(1, 4)) for v in s.token_versions]
        raise KeyError("trainer crashed")
    assert m.closed and not m._driver.thread.is_alive()


@pytest.mark.parametrize("layer", ["engine_step", "scheduler"])
def test_async_thread_survives_a_failing_step(layer):
    """A step that fails while a poison request is in flight: raised out of `engine.step` (a
    fault the engine did not isolate) the manager fails every request in flight and aborts them;
    raised inside the step the engine fails that step's requests itself. Either way they come
    back as failed samples, counted and logged, and the thread keeps generating."""
    # every sample in flight fails with the step: batches of failures come back (allowed here)
    with _manager(mode="async", max_inflight_groups=2, max_failed_fraction=1.0) as m:
        eng = m.engine

        def poisoned(seq) -> bool:  # the poison prompt, not a 99 some healthy sample generated
            return seq.tokens[:2] == [99, 2]

        def poisoned_in_flight() -> bool:
            return any(poisoned(s) for s in [*eng.scheduler.running, *eng.scheduler.waiting])

        if layer == "engine_step":
            step = eng.step

            def poisoned_step():
                if poisoned_in_flight():
                    raise OverflowError("poisoned step")
                return step()

            eng.step = poisoned_step
        else:
            schedule = eng.scheduler.schedule

            def poisoned_schedule(version):
                batch = schedule(version)
                if any(poisoned(seq) for seq, _ in batch):
                    raise OverflowError("poisoned step")
                return batch

            eng.scheduler.schedule = poisoned_schedule
        prompts = iter([[1, 2], [99, 2], *([i + 3, 2] for i in range(50))])
        batches = [m.collect(prompts, 2, n=2, sampling_params=_sp(4)) for _ in range(4)]
        stats = m.stats()
        assert m._driver.thread.is_alive()
    failed = [s for b in batches for s in b if s.failed]
    assert failed and all("OverflowError: poisoned step" in s.error for s in failed)
    assert any(s.prompt_tokens == [99, 2] for s in failed)
    assert stats["rollout/samples_failed"] == len(failed)
    assert stats["rollout/engine_step_errors"] == (1 if layer == "engine_step" else 0)
    assert all(len(s.completion_tokens) == 4 for s in batches[-1])  # generation went on


def test_from_run_config_with_text_prompts():
    run = load_config(["rollout.max_staleness=2", "engine.max_sequence_length=64"])
    model, tok, _ = build_model_and_tokenizer(run)
    with build_manager(run, model=model, tokenizer=tok) as m:
        assert m.config.max_staleness == 2 and m.engine.model is not model
        out = m.generate(["hello"], n=2, sampling_params=_sp(4))
        assert len(out) == 2 and all(isinstance(s.completion_text, str) for s in out)
        assert out[0].prompt == "hello" and len(out[0].logprobs) == 4
    with pytest.raises(ValueError, match="dp must be"):  # dp > 1: tests/test_manager_dp.py
        RolloutManager(model=model, dp=0)
    with pytest.raises(ValueError, match="cluster_options only apply"):
        RolloutManager(model=model, cluster_options={"bucket_bytes": 16})
