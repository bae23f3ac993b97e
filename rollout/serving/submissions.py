"""A client's submissions on the wire: each row checked and sized, bursts split into frames
under the coordinator's frame limit.

`add_request` refuses at once a row that cannot be encoded or that alone exceeds the limit
(learnt from the coordinator's CONNECT_ACK); a loop turn's burst leaves as SUBMIT_BATCH frames
of at most half the limit (`rollout.serving.replies.frame_bounds`), so no frame ever makes the
coordinator drop the connection. Should a queued row still fail to encode, only that row fails
(`unsendable`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.protocol import (
    MAX_ROUTING_KEY_CHARS,
    Headers,
    batch_frames,
    encode_trusted,
    pack_tokens,
)
from rollout.serving.replies import FRAME_OVERHEAD, frame_bounds

SUBMIT_ROW_OVERHEAD = 64  # bytes a submission row adds beyond its prompt, params and key
Entry = tuple[list, int]  # (wire row, its size bound)
Unsendable = Callable[[int, str], None]  # (client request id, why): that request fails


def wire_prompt(prompt: Any) -> str | bytes:
    """A prompt as it goes on the wire (text, or packed token ids); ValueError if it cannot."""
    if isinstance(prompt, str):
        if not prompt.isascii():  # isascii is O(1); only other text needs the UTF-8 check
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"prompt is not valid UTF-8 text ({e.reason} at index {e.start}: "
                    f"{prompt[e.start : e.end]!r})"
                ) from None
        wire: str | bytes = prompt
    else:
        wire = pack_tokens(prompt)
    if not wire:
        raise ValueError("prompt must not be empty")
    return wire


def row_bytes(prompt: str | bytes, sp_bytes: bytes, routing_key: str | None,
              cache_salt: str | None = None) -> int:  # fmt: skip
    """An upper bound of a submission row's size on the wire."""
    size = SUBMIT_ROW_OVERHEAD + len(sp_bytes)
    for text in (prompt, routing_key or "", cache_salt or ""):
        size += len(text) if type(text) is bytes or text.isascii() else len(text.encode())
    return size


def check_routing_key(key: Any) -> None:
    if key is None:
        return
    if not isinstance(key, str) or not 0 < len(key) <= MAX_ROUTING_KEY_CHARS:
        raise ValueError(
            f"routing_key must be None or a str of 1 to {MAX_ROUTING_KEY_CHARS} characters, "
            f"got {key!r:.80}"
        )


def too_large(crid: int, size: int, max_frame_bytes: int) -> str:
    return (f"request {crid} is {size} bytes on the wire, over the coordinator's frame "
            f"limit (max_frame_bytes={max_frame_bytes}): send a shorter prompt")  # fmt: skip


def submission_frames(
    entries: list[Entry], max_frame_bytes: int, unsendable: Unsendable
) -> list[bytes]:
    """The frames for queued entries, each under `max_frame_bytes` (a row too large for it
    fails alone: only a limit lowered since it was queued does that). add_request checked each
    row, so encoding cannot fail; if it does anyway, the rows go one frame each and a row that
    cannot be encoded fails alone."""
    if max(size for _, size in entries) + FRAME_OVERHEAD > max_frame_bytes:
        fits = []
        for row, size in entries:
            if size + FRAME_OVERHEAD <= max_frame_bytes:
                fits.append((row, size))
            else:
                unsendable(row[0], too_large(row[0], size, max_frame_bytes))
        entries = fits
    if not entries:
        return []
    sizes = [size for _, size in entries]
    rows = [row for row, _ in entries]
    try:
        return _frames(rows, sizes, max_frame_bytes)
    except Exception:
        pass
    frames = []
    for row in rows:
        try:
            frames.append(encode_trusted(Headers.SUBMIT_REQUEST, *row))
        except Exception as e:
            unsendable(row[0], f"request {row[0]}: cannot be sent: {e}")
    return frames


def _frames(rows: list[list], sizes: list[int], max_frame_bytes: int) -> list[bytes]:
    if len(rows) == 1:
        return [encode_trusted(Headers.SUBMIT_REQUEST, *rows[0])]
    if sum(sizes) <= max_frame_bytes // 2:  # the usual burst: rows bound it alone
        return batch_frames(Headers.SUBMIT_BATCH, rows)
    frames = []
    for start, stop in frame_bounds(sizes, max_frame_bytes):
        if stop - start == 1:
            frames.append(encode_trusted(Headers.SUBMIT_REQUEST, *rows[start]))
        else:
            frames += batch_frames(Headers.SUBMIT_BATCH, rows[start:stop])
    return frames
