"""Tokenizers behind one small interface: a Hugging Face `tokenizer.json` wrapper and a byte
tokenizer for tests and recipes (no files, no downloads).

Interface: `encode(text, add_bos=False) -> list[int]`, `encode_batch(texts, add_bos=False)`,
`decode(ids, skip_special_tokens=True)`, `bos_id` (None when the tokenizer has none: `add_bos`
then adds nothing), `eos_id`, `pad_id`, `eos_ids` (every id that ends a generation),
`vocab_size`. `tokenize_with`, `detokenize_with` and `eos_ids_of` put a Hugging Face
`tokenizers.Tokenizer` or `transformers` tokenizer behind the same three operations.

`decode` never raises for an int id: an id the tokenizer does not know (a model whose embedding
is padded past the tokenizer's vocabulary, as Qwen2.5's is, can emit one) becomes U+FFFD.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

MARKER_FILE = "rollout_tokenizer.json"  # written by ByteTokenizer.save
REPLACEMENT = "\ufffd"  # the text of an id the tokenizer does not know


def decode_replacing_unknown(
    decode: Callable[[list[int]], str], ids: Iterable[int], vocab_size: int
) -> str:
    """`decode` the runs of ids in [0, vocab_size), each other id becoming one U+FFFD."""
    parts: list[str] = []
    run: list[int] = []
    for i in ids:
        if 0 <= i < vocab_size:
            run.append(i)
        else:
            parts.append(decode(run) if run else "")
            run = []
    parts.append(decode(run) if run else "")
    return REPLACEMENT.join(parts)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then bos=256, eos=257, pad=258; vocab_size = 259.

    Invalid UTF-8 in `decode` (a model can emit any byte sequence) and ids past the vocabulary
    become U+FFFD.
    """

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    _SPECIAL_TEXT = {256: "<bos>", 257: "<eos>", 258: "<pad>"}

    @property
    def eos_ids(self) -> list[int]:
        return [self.eos_id]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        return [self.encode(t, add_bos=add_bos) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            special = i in self._SPECIAL_TEXT
            if not special or not skip_special_tokens:
                out.append(buf.decode("utf-8", errors="replace"))
                out.append(self._SPECIAL_TEXT[i] if special else REPLACEMENT)
                buf.clear()
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save(self, path: str | os.PathLike) -> Path:
        """Write a JSON marker so `load_tokenizer(path)` returns a ByteTokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        marker = {"type": "byte", "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                  "eos_id": self.eos_id, "pad_id": self.pad_id}  # fmt: skip
        (path / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        return path / MARKER_FILE

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


class HFTokenizer:
    """A `tokenizers.Tokenizer` with bos/eos/pad ids resolved from the files next to it.

    Special tokens are never added implicitly: `encode` adds bos only when asked, so prompts
    are tokenized the same way whatever post-processor the tokenizer.json carries. A tokenizer
    without a bos token (Qwen2.5, Qwen3) was trained on sequences that start without one, so
    `add_bos=True` adds nothing there, as HF's own `add_special_tokens` does.
    """

    def __init__(self, tokenizer: Any, bos_id: int | None, eos_ids: list[int],
                 pad_id: int | None) -> None:  # fmt: skip
        self._tok = tokenizer
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.eos_id = eos_ids[0] if eos_ids else None
        self.pad_id = pad_id if pad_id is not None else self.eos_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [*self._bos_prefix(add_bos), *ids]

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        prefix = self._bos_prefix(add_bos)
        return [prefix + e.ids for e in encs]

    def _bos_prefix(self, add_bos: bool) -> list[int]:
        """[bos] when asked and the tokenizer has one, else []."""
        return [self.bos_id] if add_bos and self.bos_id is not None else []

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        if all(0 <= i < n for i in ids):
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

        def known(run: list[int]) -> str:
            return self._tok.decode(run, skip_special_tokens=skip_special_tokens)

        return decode_replacing_unknown(known, ids, n)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_ids})"


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config values are strings or AddedToken dicts {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def load_tokenizer(path: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """Load from a directory: a ByteTokenizer marker, or HF `tokenizer.json` (+ configs).

    bos/eos come from tokenizer_config.json / special_tokens_map.json (token strings), then
    config.json / generation_config.json (ids; a generation_config eos list adds stop ids).
    """
    path = Path(path)
    if (path / MARKER_FILE).is_file():
        marker = _read_json(path / MARKER_FILE)
        if marker.get("type") != "byte":
            raise ValueError(f"{path / MARKER_FILE}: unknown tokenizer type {marker.get('type')!r}")
        return ByteTokenizer()
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json or {MARKER_FILE} in {path}")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    specials = {**_read_json(path / "special_tokens_map.json"),
                **_read_json(path / "tokenizer_config.json")}  # fmt: skip
    model_cfg = _read_json(path / "config.json")
    gen_cfg = _read_json(path / "generation_config.json")

    def resolve(name: str) -> int | None:
        text = _token_text(specials.get(f"{name}_token"))
        if text is not None:
            tid = tok.token_to_id(text)
            if tid is None:
                raise ValueError(f"{name}_token {text!r} is not in {path / 'tokenizer.json'}")
            return tid
        ids = _as_list(gen_cfg.get(f"{name}_token_id", model_cfg.get(f"{name}_token_id")))
        return ids[0] if ids else None

    eos = resolve("eos")
    eos_ids = [eos] if eos is not None else []
    for extra in _as_list(gen_cfg.get("eos_token_id")):
        if extra not in eos_ids:
            eos_ids.append(extra)
    return HFTokenizer(tok, bos_id=resolve("bos"), eos_ids=eos_ids, pad_id=resolve("pad"))


# -- adapters: this module's interface, or a Hugging Face tokenizer (the engine's view) ----------
def _hf_kind(tokenizer: Any) -> str | None:
    """Which Hugging Face package `tokenizer` comes from ("tokenizers" or "transformers"), None
    for this module's interface. transformers is not imported here (heavy, optional): an
    instance of one of its tokenizers exists only once it is."""
    if isinstance(tokenizer, Tokenizer):
        return "tokenizers"
    tf = sys.modules.get("transformers")
    if tf is not None and isinstance(tokenizer, tf.PreTrainedTokenizerBase):
        return "transformers"
    return None


def tokenize_with(tokenizer: Any, text: str, bos: bool) -> list[int]:
    """Prompts get the tokenizer's BOS (when it has one); stop words never do. Special tokens are
    never added implicitly, whatever post-processor a Hugging Face tokenizer carries."""
    kind = _hf_kind(tokenizer)
    if kind == "tokenizers":  # no BOS of its own: the text's ids
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    if kind == "transformers":
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        bos_id = tokenizer.bos_token_id
        return [bos_id, *ids] if bos and bos_id is not None else ids
    return list(tokenizer.encode(text, add_bos=bos))


def detokenize_with(tokenizer: Any, ids: list[int]) -> str | None:
    """The text of `ids` (None without a tokenizer). A tokenizer that raises for ids it does not
    know (e.g. an HF slow tokenizer) is retried with those ids as U+FFFD; the ids stay the truth."""
    if tokenizer is None:
        return None
    try:
        return tokenizer.decode(ids)
    except Exception:
        size = _vocab_size(tokenizer)
        if all(0 <= i < size for i in ids):
            raise
        return decode_replacing_unknown(tokenizer.decode, ids, size)


def _vocab_size(tokenizer: Any) -> int:
    kind = _hf_kind(tokenizer)
    if kind == "tokenizers":
        return tokenizer.get_vocab_size(with_added_tokens=True)
    if kind == "transformers":
        return len(tokenizer)  # added tokens included, unlike .vocab_size
    return tokenizer.vocab_size


def eos_ids_of(tokenizer: Any, model_config: Any) -> frozenset[int]:
    """The tokenizer's eos id(s), else the model config's `eos_token_id` (an int or a list)."""
    kind = _hf_kind(tokenizer)
    if tokenizer is None or kind == "tokenizers":  # a bare tokenizers.Tokenizer names no eos
        ids: Any = None
    elif kind == "transformers":
        ids = tokenizer.eos_token_id
    else:
        ids = tokenizer.eos_ids
    if ids is None or ids == []:
        ids = getattr(model_config, "eos_token_id", None)
    if ids is None:
        return frozenset()
    return frozenset([ids]) if isinstance(ids, int) else frozenset(int(i) for i in ids)
