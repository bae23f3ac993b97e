"""logprobs_mode end to end: SamplingParams, the sampler (generated, top-n and prompt log-probs),
the RolloutManager and the run config, and the trainer's losses recomputing the behaviour
log-probs exactly (importance weights 1 at identical weights) in both modes."""

from __future__ import annotations

import msgpack
import pytest
import torch

from rollout import LLM, InferenceConfig, SamplingParams
from rollout.engine import sampler
from rollout.rl.manager import RolloutManager
from rollout.rl.manager_config import RolloutManagerConfig
from rollout.rl.samples import collate
from rollout.sampling import logprobs_temperature
from rollout.tokenizers import ByteTokenizer
from trainer_hooks.loop import behaviour_temperature
from trainer_hooks.losses import policy_loss, sequence_log_probs

V = 50


def _logits(b: int) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(3)) * 3


# -- SamplingParams --------------------------------------------------------------------------------


def test_field_defaults_to_none_and_refuses_anything_else():
    assert SamplingParams().logprobs_mode is None
    for bad in ("raw_logprobs", "Processed", 1, True):
        with pytest.raises(ValueError, match="logprobs_mode") as exc:
            SamplingParams(logprobs_mode=bad)
        assert repr(bad) in str(exc.value)
    sp = SamplingParams(logprobs_mode="raw")
    sp.logprobs_mode = "cooked"  # changed after construction: the engine's check() catches it
    with pytest.raises(ValueError, match="logprobs_mode"):
        sp.check()


def test_a_str_enum_becomes_a_plain_str():
    from rollout.config.schema import LogprobsMode

    sp = SamplingParams(logprobs_mode=LogprobsMode.processed)
    assert type(sp.logprobs_mode) is str and sp.logprobs_mode == "processed"
    assert SamplingParams.deserialize(msgpack.unpackb(msgpack.packb(sp.serialize()))) == sp


@pytest.mark.parametrize("mode", [None, "raw", "processed"])
def test_wire_round_trip_keeps_the_mode(mode):
    sp = SamplingParams(temperature=0.7, logprobs_mode=mode)
    back = SamplingParams.deserialize(msgpack.unpackb(msgpack.packb(sp.serialize())))
    assert back == sp and back.logprobs_mode == mode
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams.deserialize({**sp.serialize(), "logprobs_mode": "processed_logprobs"})


@pytest.mark.parametrize(
    "mode, temperature, expected",
    [
        (None, 0.7, 1.0),
        ("raw", 0.7, 1.0),
        ("processed", 0.7, 0.7),
        ("processed", 1.0, 1.0),
        ("processed", 2.5, 2.5),
        ("processed", 0.0, 1.0),  # greedy: scored at temperature 1, as vLLM does
        ("processed", 1e-6, 1.0),
    ],
)
def test_logprobs_temperature(mode, temperature, expected):
    assert logprobs_temperature(mode, temperature) == expected
    sp = SamplingParams(temperature=temperature, logprobs_mode=mode)
    assert sp.logprobs_temperature == expected


# -- sampler ---------------------------------------------------------------------------------------


def test_sampler_modes_match_log_softmax_of_logits_over_t():
    logits = _logits(6)
    temps = [0.7, 0.7, 1.0, 1.0, 0.0, 2.0]
    modes = ["processed", "raw", "processed", None, "processed", "processed"]
    params = [
        SamplingParams(temperature=t, logprobs_mode=m, return_log_probs=True, top_n_logprobs=3)
        for t, m in zip(temps, modes, strict=True)
    ]
    out = sampler.sample(logits, params, list(range(6)), [4] * 6)
    for i, (t, m) in enumerate(zip(temps, modes, strict=True)):
        scale = t if m == "processed" and t > 0 else 1.0
        ref = torch.log_softmax(logits[i].double() / scale, -1)
        assert out.log_probs[i] == pytest.approx(ref[out.tokens[i]].item(), abs=1e-5)
        vals, ids = ref.topk(3)
        assert list(out.top_n[i]) == ids.tolist()
        assert list(out.top_n[i].values()) == pytest.approx(vals.tolist(), abs=1e-5)
    # processed at T=0.7 is not raw: the gap the issue measured (IS weights far from 1)
    assert abs(out.log_probs[0] - torch.log_softmax(logits[0], -1)[out.tokens[0]].item()) > 1e-3


def test_processed_ignores_top_k_and_top_p():
    """Documented choice: temperature only, as TRL and veRL recompute it."""
    logits = _logits(1)
    sp = SamplingParams(temperature=0.5, top_k=3, top_p=0.8, logprobs_mode="processed",
                        return_log_probs=True)  # fmt: skip
    out = sampler.sample(logits, [sp], [1], [0])
    ref = torch.log_softmax(logits[0] / 0.5, -1)[out.tokens[0]].item()
    assert out.log_probs[0] == pytest.approx(ref, abs=1e-5)


def test_prompt_log_probs_follow_the_mode(model):
    tok = ByteTokenizer()
    llm = LLM(model, tok, InferenceConfig(num_blocks=64))
    prompt = tok.encode("log-probs of a prompt", add_bos=True)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, :-1].double()
    for mode, t in [("raw", 0.7), ("processed", 0.7), ("processed", 0.0), (None, 1.3)]:
        sp = SamplingParams(temperature=t, logprobs_mode=mode, num_tokens_to_generate=1,
                            return_prompt_log_probs=True, top_n_logprobs=2)  # fmt: skip
        r = llm.generate(prompt, sp)
        scale = logprobs_temperature(mode, t)
        ref = torch.log_softmax(logits / scale, -1)
        want = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()
        assert r.prompt_log_probs == pytest.approx(want, abs=1e-4)
        assert list(r.prompt_top_n_logprobs[0]) == ref[0].topk(2).indices.tolist()
    llm.shutdown()


# -- the embedded LLM closes -----------------------------------------------------------------------


def test_llm_shutdown_closes_the_embedded_engine(model):
    llm = LLM(model, ByteTokenizer(), InferenceConfig(num_blocks=64))
    assert llm.generate("hi", SamplingParams(num_tokens_to_generate=2)).generated_tokens
    llm.shutdown()
    assert llm.engine.closed
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shutdown"):
        llm.generate("hi")


# -- manager and config ----------------------------------------------------------------------------


def test_manager_config_validates_and_refuses_a_conflicting_request(model):
    assert RolloutManagerConfig().logprobs_mode == "processed"
    with pytest.raises(ValueError, match="logprobs_mode"):
        RolloutManagerConfig(logprobs_mode="raw_logprobs")
    tok = ByteTokenizer()
    cfg = RolloutManagerConfig(logprobs_mode="raw")
    with RolloutManager(cfg, model=model, tokenizer=tok, inference_config=InferenceConfig(num_blocks=64)) as mgr:  # fmt: skip
        with pytest.raises(ValueError, match="logprobs_mode='processed' differs"):
            mgr.generate([[1, 2, 3]], sampling_params=SamplingParams(logprobs_mode="processed"))
        assert mgr.generate([[1, 2, 3]], sampling_params=SamplingParams(logprobs_mode="raw"))


def test_run_config_carries_the_mode_to_manager_and_sampling_params():
    from rollout.config import load_config
    from rollout.config.builders import manager_config, sampling_params

    run = load_config([])
    assert run.rollout.logprobs_mode.value == "processed"
    assert manager_config(run).logprobs_mode == "processed"
    assert sampling_params(run).logprobs_mode == "processed"
    run = load_config(["rollout.logprobs_mode=raw"])
    assert manager_config(run).logprobs_mode == sampling_params(run).logprobs_mode == "raw"
    with pytest.raises(Exception, match="logprobs_mode"):
        load_config(["rollout.logprobs_mode=raw_logprobs"])


# -- the trainer recomputes the behaviour log-probs exactly -----------------------------------------


def test_losses_refuse_a_bad_temperature():
    logits, tokens = torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.long)
    for bad in (0.0, -1.0, True, "0.7"):
        with pytest.raises(ValueError, match="temperature"):
            sequence_log_probs(logits, tokens, temperature=bad)


@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_importance_weights_are_one_at_identical_weights(model, mode, temperature):
    """Real engine, real collate, the loss's own recompute: exp(old - behaviour) == 1 for every
    token, in both modes at T=0.7 and T=1 (in processed mode at T=0.7 the old code, which always
    scored raw, was off by up to several nats)."""
    tok = ByteTokenizer()
    cfg = RolloutManagerConfig(logprobs_mode=mode)
    sp = SamplingParams(temperature=temperature, num_tokens_to_generate=8, ignore_eos=True)
    with RolloutManager(cfg, model=model, tokenizer=tok, inference_config=InferenceConfig(num_blocks=64)) as mgr:  # fmt: skip
        samples = mgr.generate([tok.encode(p, add_bos=True) for p in ("ab", "xyz")], n=4, sampling_params=sp)  # fmt: skip
        t = behaviour_temperature(mgr, sp)
    assert t == (temperature if mode == "processed" else 1.0)
    batch = collate(samples, pad_id=tok.pad_id)
    mask = batch["completion_mask"]
    with torch.no_grad():
        logits = model(batch["tokens"])
    old = sequence_log_probs(logits, batch["tokens"], mask, temperature=t)
    _, metrics = policy_loss(old, old, torch.ones(len(samples)), mask,
                             behaviour_logp=batch["behaviour_logp"], tis_cap=2.0)  # fmt: skip
    w = torch.exp(old - batch["behaviour_logp"])[mask.bool()]
    assert w.numel() == 8 * len(samples)
    assert torch.allclose(w, torch.ones_like(w), atol=1e-4), (w.min(), w.max())
    assert metrics["mismatch/is_weight_raw_max"] == pytest.approx(1.0, abs=1e-4)
    if temperature != 1.0:  # the other mode's recompute is wrong: the mode matters
        wrong = sequence_log_probs(logits, batch["tokens"], mask, temperature=temperature if t == 1.0 else 1.0)  # fmt: skip
        assert (wrong - batch["behaviour_logp"])[mask.bool()].abs().max() > 1e-2
