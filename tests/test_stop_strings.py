"""Stop strings match the decoded text, as OpenAI and vLLM do: inside one token, across token
boundaries, with the token that completed the stop string kept in the ids and the text cut at
the stop string (kept with include_stop_str_in_output). A seeded request with stop strings
against the same request without them (seeded sampling depends only on seed and position)."""

from __future__ import annotations

import pytest
from reference import prompts_of, tiny_model

from rollout.detokenizer import IncrementalDetokenizer, text_offsets
from rollout.engine import DynamicInferenceEngine, InferenceConfig
from rollout.sampling import SamplingParams

N = 12


class WordTokenizer:
    """id i <-> "i|" (so one token is several characters); byte ids >= 250 are multi-byte
    halves: 250+251 decode to "é", either alone to U+FFFD."""

    bos_id = None
    eos_ids: list[int] = []
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [int(x) for x in text.split("|") if x]

    def decode(self, ids) -> str:
        out, half = [], None
        for i in ids:
            if i in (250, 251):
                if half == 250 and i == 251:
                    out[-1] = "é"
                    half = None
                    continue
                out.append("\ufffd")
                half = i
            else:
                out.append(f"{i}|")
                half = None
        return "".join(out)


@pytest.fixture(scope="module")
def run():
    prompt = prompts_of([7], seed=5)[0]
    eng = DynamicInferenceEngine(tiny_model(), WordTokenizer(), InferenceConfig(num_blocks=64))

    def go(**kw):
        sp = SamplingParams(seed=3, num_tokens_to_generate=N, ignore_eos=True, **kw)
        return eng.generate([prompt], sp)[0]

    free = go().generated_tokens
    assert len(set(free)) > N // 2  # varied text to find stop strings in
    return free, go


def _first_new(texts: list[str], k0: int, width: int, offset: int) -> tuple[int, str]:
    """The first token k >= k0 whose substring [offset, offset+width) of the joined text
    starting inside token k does not occur earlier."""
    for k in range(k0, N - 1):
        before = "".join(texts[:k])
        s = "".join(texts[k:])[offset : offset + width]
        if s not in before + s[:-1]:
            return k, s
    pytest.skip("no unique substring in this greedy continuation")


def test_a_stop_string_inside_one_token(run):
    free, go = run
    texts = [f"{t}|" for t in free]
    k, stop = _first_new(texts, 2, 2, 1)  # the token's 2nd and 3rd characters
    rec = go(stop_words=[stop])
    assert rec.stop_reason == "stop_word"
    assert rec.generated_tokens == free[: k + 1]  # the token that completed it is kept
    cut = "".join(texts[:k]) + texts[k][:1]
    assert rec.generated_text == cut
    kept = go(stop_words=[stop], include_stop_str_in_output=True)
    assert kept.generated_tokens == free[: k + 1] and kept.generated_text == cut + stop


def test_a_stop_string_across_token_boundaries(run):
    free, go = run
    texts = [f"{t}|" for t in free]
    k, _ = _first_new(texts, 3, 1, 0)
    stop = texts[k][-2:] + texts[k + 1]  # the end of token k, all of token k+1
    if stop in "".join(texts[: k + 1]):
        pytest.skip("stop string occurs earlier")
    rec = go(stop_words=["no such text", stop])
    assert rec.generated_tokens == free[: k + 2]
    assert rec.generated_text == "".join(texts[:k]) + texts[k][:-2]


def test_no_match_runs_to_the_length_limit(run):
    free, go = run
    rec = go(stop_words=["x"])
    assert rec.stop_reason == "length" and rec.generated_tokens == free
    assert rec.generated_text == "".join(f"{t}|" for t in free)


def test_incremental_text_holds_back_an_incomplete_character():
    tok = WordTokenizer()
    d = IncrementalDetokenizer(tok.decode)
    assert [d.add(t) for t in (7, 250, 251, 8)] == ["7|", "", "é", "8|"]
    assert d.text == tok.decode([7, 250, 251, 8])
    assert text_offsets(tok.decode, [7, 250, 251, 8], start=3) == [3, 5, 5, 6]
    tail = IncrementalDetokenizer(tok.decode, [7, 250])
    assert tail.text == "7|" and tail.flush() == "\ufffd"
