"""Incremental detokenization: the text of a growing token list, one token at a time, and the
character offset at which each token's text begins.

Decoding one token alone is wrong for many tokenizers (a UTF-8 character split over byte
tokens, SentencePiece's leading-space rule), and decoding the whole list after every token is
quadratic. As vLLM and TGI do, each step decodes a short window twice, with and without the
newest tokens, and emits the difference; text ending in U+FFFD (an incomplete character) is
held back until the next token completes it. The emitted text is what `decode(all ids)` gives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"
WINDOW = 6  # tokens of context before the unread ones: enough for any merge at the boundary


class IncrementalDetokenizer:
    """`add(token)` returns the text that token completes (often "", while a character is
    still partial); `text` is everything emitted so far."""

    def __init__(self, decode: Callable[[list[int]], str], ids: Iterable[int] = ()) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # the window's start
        self._read = 0  # ids before this are emitted
        for t in ids:
            self.add(t)

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        delta = after[len(before) :]
        self._prefix = max(self._read, len(self.ids) - WINDOW)
        self._read = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the end), as decode gives it."""
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        delta = self._decode(self.ids[self._prefix :])[len(before) :]
        self._read = len(self.ids)
        self.text += delta
        return delta


class TextOffsets:
    """The offset into the decoded text (plus `start`) at which each token's text begins, for a
    token list that arrives in chunks (a stream's): a token that only starts a character begins
    where that character does."""

    def __init__(self, decode: Callable[[list[int]], str], start: int = 0) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self.start = start

    def __call__(self, ids: Iterable[int]) -> list[int]:
        offsets = []
        for t in ids:
            offsets.append(self.start + len(self._detok.text))
            self._detok.add(t)
        return offsets


def text_offsets(decode: Callable[[list[int]], str], ids: list[int], start: int = 0) -> list[int]:
    """TextOffsets of a whole token list."""
    return TextOffsets(decode, start)(ids)


def find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last `new_chars` characters of `text`:
    (its start, the string). Earlier text was checked when it arrived."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
