"""A tokenizer whose text is the token ids: '12 34' <-> [12, 34], so tests name stop words by id."""

from __future__ import annotations


class IdTokenizer:
    bos_id = None
    eos_ids: list[int] = []

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)
