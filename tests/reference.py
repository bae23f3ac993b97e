"""The tests' ground truth: greedy decoding with no KV cache, and the tiny models they run.

The engine's paged KV cache, prefix sharing, chunked prefill and suspend/resume must all yield
exactly the tokens of the plainest possible decode: the whole sequence through `model.forward`
for every new token, then argmax (first index on ties, like the sampler's greedy path).
"""

from __future__ import annotations

import torch

from rollout.models import ModelConfig, build_model
from rollout.tokenizers import ByteTokenizer

BYTE_VOCAB = ByteTokenizer.vocab_size  # 256 bytes + bos, eos, pad


def tiny_model(seed: int = 0, vocab_size: int = BYTE_VOCAB, **overrides) -> torch.nn.Module:
    """The tiny preset in eval mode, its weights fixed by `seed`."""
    config = ModelConfig.preset("tiny", vocab_size=vocab_size, **overrides)
    return build_model(config, seed=seed).eval()


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Random byte-range prompts of the given lengths, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def greedy(
    model: torch.nn.Module, prompt: list[int], n: int, memo: dict | None = None
) -> list[int]:
    """The `n` tokens greedy decoding generates after `prompt` (eos is not special).

    `memo`, a dict the caller owns, keeps each (model, prompt)'s longest continuation so far:
    a shorter greedy continuation is its prefix, so a longer one resumes from it. Only for
    models whose weights stay fixed while the memo lives.
    """
    key = (id(model), tuple(prompt))
    toks = list(prompt) + (memo.get(key, []) if memo is not None else [])
    while len(toks) < len(prompt) + n:
        toks.append(int(model(torch.tensor([toks]))[0, -1].argmax()))
    if memo is not None:
        memo[key] = toks[len(prompt) :]
    return toks[len(prompt) : len(prompt) + n]


def greedy_switched(
    before: torch.nn.Module, after: torch.nn.Module, prompt: list[int], n: int, switch_at: int
) -> list[int]:
    """Greedy decoding whose weights change from `before` to `after` at generated token
    `switch_at`: a weight update in the middle of a generation. With no cache, the tokens after
    the switch are `after`'s greedy continuation of the prompt plus the tokens before it."""
    first = greedy(before, prompt, min(n, switch_at))
    return first + greedy(after, prompt + first, n - len(first))
