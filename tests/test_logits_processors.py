"""vLLM's logits parameters, each checked by effect: the engine's tokens equal a reference loop
that runs the no-cache model and applies transformers' logits processor for the same parameter
(a hand-written one where transformers has none), through evictions, async scheduling and a
re-dispatch; processed log-probs equal the trainer's recomputation (`logits_processors.process`)."""

from __future__ import annotations

import math

import pytest
import torch
from id_tokenizer import IdTokenizer
from reference import prompts_of, tiny_model
from transformers.generation import logits_process as hf

from rollout.engine import DynamicInferenceEngine, InferenceConfig, sampler
from rollout.engine.logits_processors import process
from rollout.sampling import SamplingParams
from rollout.serving.resume import resume_record

N = 12
PROMPT = prompts_of([9], seed=5)[0]


def engine(model, **kw):
    kw.setdefault("num_blocks", 256)
    return DynamicInferenceEngine(model, IdTokenizer(), InferenceConfig(**kw))


@torch.no_grad()
def reference(model, prompt, n, processors, stop=(), temperature=0.0, seed=0, min_p=0.0):
    """Tokens (and raw logits per step) of the plainest decode: the whole sequence through the
    model for each token, the processors on its last logits, then argmax, or (temperature > 0)
    the engine's uniform draw for (seed, position) by inverse CDF over softmax(scores / T)."""
    toks, raw = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([toks]))[0, -1:].float()
        raw.append(logits[0])
        scores = logits.clone()
        for p in processors:
            scores = p(torch.tensor([toks]), scores)
        if temperature == 0.0:
            t = int(scores[0].argmax())
        else:
            scores = scores / temperature
            if min_p:
                scores = hf.MinPLogitsWarper(min_p)(torch.tensor([toks]), scores)
            cdf = torch.softmax(scores[0], -1).double().cumsum(-1)
            u = sampler.uniform(seed, len(toks))
            t = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True))
        toks.append(t)
        if t in stop:
            break
    return toks[len(prompt) :], raw


def run(eng, sp, prompt=PROMPT):
    return eng.generate([prompt], sp)[0]


GREEDY = dict(temperature=0.0, num_tokens_to_generate=N, ignore_eos=True)


def test_repetition_penalty_matches_transformers(model):
    plain = run(engine(model), SamplingParams(**GREEDY)).generated_tokens
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself: the penalty bites
    for penalty in (1.8, 0.6):
        out = run(engine(model), SamplingParams(**GREEDY, repetition_penalty=penalty))
        ref, _ = reference(model, PROMPT, N, [hf.RepetitionPenaltyLogitsProcessor(penalty)])
        assert out.generated_tokens == ref
        assert (ref != plain) == (penalty > 1)  # below 1 it favours the repeats it already makes


def _presence_frequency(prompt_len, presence, frequency):
    """OpenAI's definition over the generated tokens: logit -= count * frequency + (count > 0)
    * presence (transformers has no processor for it)."""

    def apply(ids, scores):
        gen = ids[0, prompt_len:]
        counts = torch.bincount(gen, minlength=scores.shape[-1]).to(scores.dtype)
        return scores - counts * frequency - (counts > 0).to(scores.dtype) * presence

    return apply


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.9), (-0.5, 1.2)])
def test_presence_and_frequency_penalties(model, presence, frequency):
    sp = SamplingParams(**GREEDY, presence_penalty=presence, frequency_penalty=frequency)
    out = run(engine(model), sp)
    ref, _ = reference(model, PROMPT, N, [_presence_frequency(len(PROMPT), presence, frequency)])
    assert out.generated_tokens == ref
    assert ref != run(engine(model), SamplingParams(**GREEDY)).generated_tokens


def test_min_tokens_matches_transformers(model):
    """The stop token the plain decode emits early is banned (and stop words unmatched) until
    min_tokens tokens exist; afterwards it stops the request again."""
    stop = run(engine(model), SamplingParams(**GREEDY)).generated_tokens[0]
    early = run(engine(model), SamplingParams(**GREEDY, stop_token_ids=[stop]))
    assert early.stop_reason == "stop_token" and early.generated_tokens == [stop]
    sp = SamplingParams(**GREEDY, stop_token_ids=[stop], min_tokens=6)
    out = run(engine(model), sp)
    proc = hf.MinNewTokensLengthLogitsProcessor(len(PROMPT), 6, [stop])
    ref, _ = reference(model, PROMPT, N, [proc], stop=(stop,))
    assert out.generated_tokens == ref and len(ref) >= 6
    assert stop not in ref[:6]


def test_min_tokens_also_holds_stop_words(model):
    plain = run(engine(model), SamplingParams(**GREEDY)).generated_tokens
    word = str(plain[1])
    assert (
        run(engine(model), SamplingParams(**GREEDY, stop_words=[word])).stop_reason == "stop_word"
    )
    out = run(engine(model), SamplingParams(**GREEDY, stop_words=[word], min_tokens=N - 1))
    # matched again from token min_tokens on: it ends there
    assert out.stop_reason == "stop_word" and out.generated_tokens == plain[: N - 1]


def test_bad_words_match_transformers(model):
    plain = run(engine(model), SamplingParams(**GREEDY)).generated_tokens
    single = [plain[0]]  # the token it repeats
    out = run(engine(model), SamplingParams(**GREEDY, bad_words=[str(single[0])]))
    first, _ = reference(model, PROMPT, N, [hf.NoBadWordsLogitsProcessor([single])])
    assert out.generated_tokens == first and single[0] not in first
    pair = first[2:4]  # two tokens it then emits in a row
    assert PROMPT[-1] != pair[0]  # (transformers also matches across the prompt's end)
    words = [str(single[0]), f"{pair[0]} {pair[1]}"]
    out = run(engine(model), SamplingParams(**GREEDY, bad_words=words))
    ref, _ = reference(model, PROMPT, N, [hf.NoBadWordsLogitsProcessor([single, pair])])
    assert out.generated_tokens == ref != first


def test_logit_bias_and_allowed_token_ids_match_transformers(model):
    plain = run(engine(model), SamplingParams(**GREEDY)).generated_tokens
    bias = {plain[0]: -100.0, 7: 5.5, 200: 3.0}
    out = run(engine(model), SamplingParams(**GREEDY, logit_bias=bias))
    proc = hf.SequenceBiasLogitsProcessor([[[k], v] for k, v in bias.items()])
    ref, _ = reference(model, PROMPT, N, [proc])
    assert out.generated_tokens == ref != plain

    allowed = [3, 50, 99, 120, plain[1]]
    out = run(engine(model), SamplingParams(**GREEDY, allowed_token_ids=allowed))
    proc = hf.PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1)
    ref, _ = reference(model, PROMPT, N, [proc])
    assert out.generated_tokens == ref and set(ref) <= set(allowed)


def test_min_p_sampling_matches_transformers():
    """min_p truncates after temperature (transformers' MinPLogitsWarper); the draw is the
    engine's per-(seed, position) uniform, so the reference draws the same numbers. Batch-
    invariant (a private model: the mode is set on it, and its dense forward then runs the
    engine's ops): the reference's logits are the engine's bits (default mode's paged and dense
    forwards differ by ~1e-6, enough to move a draw near a CDF boundary); what differs is the
    fp64 CDF's summation order, ~1e-16."""
    model = tiny_model(seed=0)
    refs = []
    for min_p in (0.0, 0.9):
        sp = SamplingParams(temperature=1.3, num_tokens_to_generate=N, ignore_eos=True, seed=11,
                            min_p=min_p)  # fmt: skip
        out = run(engine(model, batch_invariant=True), sp)
        assert model.batch_invariant  # the reference's forward: the same ops
        refs.append(reference(model, PROMPT, N, [], temperature=1.3, seed=11, min_p=min_p)[0])
        assert out.generated_tokens == refs[-1]
    assert refs[0] != refs[1]


@pytest.mark.parametrize(
    "kw",
    [dict(block_size=4, num_blocks=12, max_requests=8), dict(async_scheduling=True)],
    ids=["evictions", "async_scheduling"],
)
def test_penalties_and_min_tokens_survive_evictions_and_overlap(model, kw):
    """Counts come from the request's tokens, so a request evicted (checkpointed and
    recomputed) or decoded with async scheduling samples what an uninterrupted one does."""
    prompts = prompts_of([9, 14, 5, 11], seed=8)
    sp = SamplingParams(**GREEDY, repetition_penalty=1.5, frequency_penalty=0.4, min_tokens=4)
    out = engine(model, **kw).generate(prompts, sp)
    pen = [hf.RepetitionPenaltyLogitsProcessor(1.5)]
    for p, r in zip(prompts, out, strict=True):
        ref, _ = reference(model, p, N, [*pen, _presence_frequency(len(p), 0.0, 0.4)])
        assert r.generated_tokens == ref


def test_penalties_survive_a_re_dispatch(model):
    """A request resumed on another engine from what it streamed (the coordinator's
    re-dispatch) counts the tokens generated before it moved as generated."""
    sp = SamplingParams(**GREEDY, presence_penalty=1.5, min_tokens=0)
    ref, _ = reference(model, PROMPT, N, [_presence_frequency(len(PROMPT), 1.5, 0.0)])
    first = ref[:5]
    from rollout.protocol import pack_tokens, pack_versions

    record = resume_record(0, torch.tensor(PROMPT), sp, 16, pack_tokens(first), b"",
                           pack_versions([0] * 5))  # fmt: skip
    eng = engine(model)
    eng.add_request(None, record=record)
    done = []
    while eng.has_unfinished_requests():
        done += eng.step().finished
    assert done[0].merge().generated_tokens == ref


def test_processed_log_probs_are_what_the_trainer_recomputes(model):
    """processed: log_softmax(processed logits / T), what the token was drawn from; raw: the
    model's own log_softmax, whatever the processors. `process` rebuilds the processed logits
    from the trainer's logits and the tokens."""
    kw = dict(temperature=0.8, num_tokens_to_generate=N, ignore_eos=True, seed=3,
              repetition_penalty=1.3, presence_penalty=0.5, logit_bias={5: 2.0}, min_tokens=3,
              return_log_probs=True)  # fmt: skip
    for mode in ("processed", "raw"):
        sp = SamplingParams(**kw, logprobs_mode=mode)
        out = run(engine(model), sp)
        toks = out.generated_tokens
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + toks]))[0, len(PROMPT) - 1 : -1].float()
        if mode == "processed":
            eos = engine(model)._eos
            logits = process(logits, sp, PROMPT, toks, IdTokenizer(), eos) / 0.8
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None])[:, 0]
        assert out.generated_log_probs == pytest.approx(want.tolist(), abs=1e-4)
        assert all(math.isfinite(x) for x in out.generated_log_probs)


def test_a_request_whose_every_token_is_banned_fails_alone(model):
    eng = engine(model)
    ok = SamplingParams(**GREEDY)
    bad = SamplingParams(**GREEDY, allowed_token_ids=[4], bad_words=["4"])
    r_ok = eng.add_request(None, PROMPT, ok)
    r_bad = eng.add_request(None, PROMPT, bad)
    while eng.has_unfinished_requests():
        eng.step()
    assert r_bad.requests[-1].status.name == "FAILED"
    assert "allowed_token_ids" in _error(r_bad)
    assert len(r_ok.merge().generated_tokens) == N


def test_out_of_vocab_ids_fail_the_request_naming_the_parameter(model):
    eng = engine(model)
    for sp in (SamplingParams(**GREEDY, logit_bias={10_000: 1.0}),
               SamplingParams(**GREEDY, allowed_token_ids=[1, 10_000])):  # fmt: skip
        rec = eng.add_request(None, PROMPT, sp)
        name = "logit_bias" if sp.logit_bias else "allowed_token_ids"
        assert rec.requests[-1].status.name == "FAILED" and name in _error(rec)


def _error(record) -> str:
    return str([e.payload for e in record.requests[-1].events if e.payload])


# -- RolloutManager: refused by name unless the trainer opts in ----------------------------------


def test_manager_refuses_processors_by_name_unless_allowed(model):
    from rollout.rl.manager import RolloutManager
    from rollout.rl.manager_config import RolloutManagerConfig

    icfg = InferenceConfig(num_blocks=64)
    sp = SamplingParams(temperature=0.9, num_tokens_to_generate=6, ignore_eos=True, seed=2,
                        repetition_penalty=1.4, bad_words=["7"])  # fmt: skip
    with RolloutManager(RolloutManagerConfig(), model=model, tokenizer=IdTokenizer(),
                        inference_config=icfg) as mgr:  # fmt: skip
        with pytest.raises(
            ValueError, match=r"sampling_params\.bad_words .*allow_logits_processors"
        ):
            mgr.generate([PROMPT], sampling_params=sp)
        assert mgr.generate([PROMPT], sampling_params=sp.replace(  # truncations are not refused
            repetition_penalty=1.0, bad_words=[], min_p=0.1, top_k=-1))  # fmt: skip
        grammar = sp.replace(repetition_penalty=1.0, bad_words=[],
                             structured_outputs={"choice": ["yes", "no"]})  # fmt: skip
        with pytest.raises(ValueError, match=r"sampling_params\.structured_outputs .*allow_logits"):
            mgr.generate([PROMPT], sampling_params=grammar)  # the mask reshapes the logits too
    cfg = RolloutManagerConfig(allow_logits_processors=True)
    with RolloutManager(cfg, model=model, tokenizer=IdTokenizer(), inference_config=icfg) as mgr:
        sample = mgr.generate([PROMPT], sampling_params=sp)[0]
        eos = mgr.engine._eos
    toks = sample.completion_tokens
    assert 7 not in toks
    with torch.no_grad():  # the trainer's side: its logits, processed as the engine did
        logits = model(torch.tensor([PROMPT + toks]))[0, len(PROMPT) - 1 : -1]
    logits = process(logits, sp, PROMPT, toks, IdTokenizer(), eos) / 0.9
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None])[:, 0]
    assert sample.logprobs == pytest.approx(want.tolist(), abs=1e-4)
    from rollout.rl.replay import check_replayable

    with pytest.raises(ValueError, match="bad_words, repetition_penalty"):
        check_replayable(sample)  # a replayed segment restarts from a prompt: not covered
