"""One streamed choice's text, decoded incrementally.

Re-decoding a choice's whole text at every partial costs CPU in the square of its length (n=8 x
4,000 tokens took 2.0 s streamed against 0.42 s unstreamed). Each new token is decoded once, by
the engine's incremental detokenizer (a short window, rollout/detokenizer.py), which also holds
back an incomplete UTF-8 character until it resolves; the finished text is what decoding all the
ids at once gives.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.detokenizer import IncrementalDetokenizer

Decode = Callable[[list[int]], str]


class StreamedText:
    """The text of a growing token list (`add`), and what of it is safe to send: all but the
    last `hold` characters, which may begin a stop string."""

    def __init__(self, decode: Decode, hold: int = 0) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self.hold = hold
        self.sent = ""

    def add(self, tokens: list[int]) -> str:
        """The text so far (incomplete characters held back)."""
        for t in tokens:
            self._detok.add(t)
        return self._detok.text

    def stable(self) -> str:
        """The text so far less the held-back end."""
        text = self._detok.text
        return text[: max(0, len(text) - self.hold)]

    def delta(self) -> str:
        """What of `stable()` was not sent yet (marked sent)."""
        stable = self.stable()
        if not stable.startswith(self.sent):
            return ""
        out, self.sent = stable[len(self.sent) :], stable
        return out

    def finish(self, tokens: list[int]) -> str:
        """The whole text once the last `tokens` arrived (held-back characters flushed)."""
        self.add(tokens)
        self._detok.flush()
        return self._detok.text
