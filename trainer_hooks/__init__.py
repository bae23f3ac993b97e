"""Callbacks that drive a RolloutManager from a trainer.

`hooks` (the protocol + RolloutHooks) and `loop` (a plain PyTorch GRPO loop) are exported lazily so
`trainer_hooks.losses` stays importable on its own; the adapters import their framework, so load
them explicitly: `trainer_hooks.hf` (extra `hf`) and `trainer_hooks.lightning` (extra `lightning`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RolloutHooks": "trainer_hooks.hooks",
    "TrainerHook": "trainer_hooks.hooks",
    "grpo_loss": "trainer_hooks.loop",
    "train": "trainer_hooks.loop",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_hooks' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
