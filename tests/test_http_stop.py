"""Stop strings over HTTP: cut from `text` (kept with vLLM's include_stop_str_in_output), also
in streams, which never send text past the stop string."""

from __future__ import annotations

import pytest
from test_http_server import served  # noqa: F401 (the module's server fixture)

pytestmark = pytest.mark.timeout(120)

KW = dict(model="tiny", prompt="hello", max_tokens=24, seed=7, temperature=1.0)


def _stop_in(text: str) -> str:
    """A 2-character string first found at a position > 4 of `text`."""
    for i in range(5, len(text) - 2):
        s = text[i : i + 2]
        if s not in text[: i + 1] and "\ufffd" not in s:
            return s
    pytest.skip("no usable stop string in this sample")


def test_stop_strings_are_cut_from_the_text(served):  # noqa: F811
    oai = served.openai()
    free = oai.completions.create(**KW, extra_body={"ignore_eos": True}).choices[0].text
    stop = _stop_in(free)
    c = oai.completions.create(**KW, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert c.finish_reason == "stop" and c.text == free[: free.index(stop)]
    kept = oai.completions.create(**KW, stop=stop, extra_body={
        "ignore_eos": True, "include_stop_str_in_output": True}).choices[0]  # fmt: skip
    assert kept.text == free[: free.index(stop) + len(stop)]
    chunks = oai.completions.create(**KW, stop=[stop], stream=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
