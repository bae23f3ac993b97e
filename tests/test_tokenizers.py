"""ByteTokenizer and the HF tokenizer.json wrapper behind one interface."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    detokenize_with,
    eos_ids_of,
    load_tokenizer,
    tokenize_with,
)

CORPUS = ["the quick brown fox", "jumps over the lazy dog", "héllo wörld 你好", "rollout rollout"]


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode([*tok.encode(text), tok.eos_id, tok.pad_id]) == text


def test_byte_specials_and_errors(tmp_path):
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.decode([104, 105, 257], skip_special_tokens=False) == "hi<eos>"
    assert tok.decode([0xE4, 0xBD]) == "\ufffd"  # truncated UTF-8 from a model is not fatal
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    tok.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


@pytest.fixture
def hf_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    return tmp_path


def test_hf_tokenizer_loads_and_round_trips(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.eos_ids == [2, 3]
    assert tok.vocab_size > 256
    for text in [*CORPUS, "unseen ✓ text 123"]:
        ids = tok.encode(text)
        assert tok.bos_id not in ids
        assert tok.decode(ids) == text
        assert tok.encode(text, add_bos=True) == [tok.bos_id, *ids]
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges learned
    assert tok.encode_batch(CORPUS, add_bos=True) == [tok.encode(t, add_bos=True) for t in CORPUS]
    ids = [*tok.encode("hi"), tok.eos_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi</s>"
    # ids past the vocabulary (a padded embedding emits them) are U+FFFD, never an error
    assert (
        tok.decode([*tok.encode("hi"), 10**6, tok.vocab_size, *tok.encode("yo")])
        == "hi\ufffd\ufffdyo"
    )
    assert tok.decode([-1]) == "\ufffd"


def test_hf_tokenizer_ids_from_model_config(hf_dir):
    (hf_dir / "tokenizer_config.json").unlink()
    (hf_dir / "generation_config.json").unlink()
    (hf_dir / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 3}))
    tok = load_tokenizer(hf_dir)
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (1, 3, [3], 3)


def test_load_tokenizer_errors(hf_dir, tmp_path_factory):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path_factory.mktemp("empty"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="<nope>"):
        load_tokenizer(hf_dir)


def test_hf_tokenizer_without_bos_adds_none(hf_dir):
    """Qwen2.5/Qwen3 ship no bos token: add_bos=True leaves the prompt as the text's ids."""
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(hf_dir)
    assert tok.bos_id is None and tok.eos_id == 2
    for text in CORPUS:
        assert tok.encode(text, add_bos=True) == tok.encode(text)
    assert tok.encode_batch(CORPUS, add_bos=True) == [tok.encode(t) for t in CORPUS]


def test_byte_decode_of_ids_past_the_vocabulary_is_replacement_text():
    """A model whose vocabulary is larger than the tokenizer's can emit any id below its own
    vocab_size: decode must return text (U+FFFD per unknown id), never raise."""
    tok = ByteTokenizer()
    assert tok.decode([104, 259, 105]) == "h\ufffdi"
    assert tok.decode([104, 300, 301, 105, 257]) == "h\ufffd\ufffdi"
    assert tok.decode([0xE4, 999, 0xBD]) == "\ufffd\ufffd\ufffd"  # splits the broken UTF-8 too
    assert tok.decode([2**40, -5]) == "\ufffd\ufffd"


def test_adapters_on_this_modules_tokenizers(hf_dir):
    """tokenize_with / detokenize_with / eos_ids_of are encode / decode / eos_ids here."""
    for tok in (ByteTokenizer(), load_tokenizer(hf_dir)):
        ids = tok.encode("the fox")
        assert tokenize_with(tok, "the fox", bos=True) == [tok.bos_id, *ids]
        assert tokenize_with(tok, "the fox", bos=False) == ids
        assert detokenize_with(tok, [*ids, tok.eos_id]) == "the fox"
        assert eos_ids_of(tok, None) == frozenset(tok.eos_ids)
    assert detokenize_with(None, [1, 2]) is None


class _Config:
    eos_token_id = [7, 8]


def test_adapters_on_hugging_face_tokenizers(hf_dir):
    """A bare `tokenizers.Tokenizer` (no BOS, no eos of its own) and a `transformers` one (its
    bos/eos ids; special tokens never added implicitly) behind the same adapters."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    ours = load_tokenizer(hf_dir)
    ids = ours.encode("the fox")
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tokenize_with(raw, "the fox", bos=True) == ids
    assert detokenize_with(raw, [*ids, ours.eos_id]) == "the fox"
    assert eos_ids_of(raw, _Config()) == frozenset([7, 8])  # the model config's

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>",
                                              eos_token="</s>")  # fmt: skip
    assert tokenize_with(hf, "the fox", bos=True) == [ours.bos_id, *ids]
    assert tokenize_with(hf, "the fox", bos=False) == ids
    assert detokenize_with(hf, ids) == "the fox"
    assert eos_ids_of(hf, _Config()) == frozenset([ours.eos_id])


def test_detokenize_with_retries_a_decode_that_raises_on_unknown_ids():
    class Strict(ByteTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            if any(i >= self.vocab_size for i in ids):
                raise IndexError("unknown id")
            return super().decode(ids, skip_special_tokens)

    assert detokenize_with(Strict(), [104, 999, 105]) == "h\ufffdi"
