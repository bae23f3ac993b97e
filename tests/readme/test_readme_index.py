"""The README itself: every command it documents is run by a test of this folder, every ```python
block executed, and its metric namespaces are the logged ones."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from readme_helpers import (
    COVERED,
    NOT_RUN,
    README,
    SNIPPETS,
    python_snippets,
    readme_commands,
)

from rollout.metrics import NAMESPACES


def readme_tests() -> set[str]:
    """The test functions of this folder's modules (those COVERED and SNIPPETS may name)."""
    names: set[str] = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        names |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    return {n for n in names if n.startswith("test_")}


def test_every_readme_command_is_covered():
    commands = readme_commands(README)
    assert "bash scripts/main.sh" in commands and "engine=gpu" in commands  # the parser works
    missing = [c for c in commands if c not in COVERED and c not in NOT_RUN]
    assert not missing, f"README commands no test runs (add them to COVERED): {missing}"
    stale = [c for c in [*COVERED, *NOT_RUN] if c not in commands]
    assert not stale, f"COVERED/NOT_RUN entries no longer in README.md: {stale}"
    tests = readme_tests()
    assert set(COVERED.values()) <= tests, set(COVERED.values()) - tests
    snippets = python_snippets(README)
    assert set(snippets) == set(SNIPPETS), f"README python blocks vs SNIPPETS: {sorted(snippets)}"
    assert set(SNIPPETS.values()) <= tests


def test_readme_lists_the_metric_namespaces():
    """The README's namespace list is `rollout.metrics.NAMESPACES`, no more, no less."""
    m = re.search(r"logs to W&B under (.*?)`rollout\.metrics\.NAMESPACES`", README, re.S)
    assert m, "README.md no longer lists the namespaces the recipe logs under"
    assert set(re.findall(r"`(\w+)/\*`", m.group(1))) == set(NAMESPACES)
