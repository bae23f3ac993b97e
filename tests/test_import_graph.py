"""The package layout is the architecture: imports go down the layers, never up, never round.

The graph is read from the source (every import, including those inside functions, which is
how cycles used to be dodged) so a cycle or an upward import fails here before it can bite at
run time. Each package is also imported alone in a fresh interpreter, the way a worker or
coordinator process starts.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("rollout", "trainer_hooks", "recipes")

# Lowest first. A module may import modules of its own layer or a lower one.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("rollout.codecs", "rollout.events", "rollout.sampling", "rollout.structured_outputs",
     "rollout.request",
     "rollout.protocol", "rollout.hashing", "rollout.tokenizers", "rollout.detokenizer",
     "rollout.metrics"),
    ("rollout.models",),
    ("rollout.weights",),
    ("rollout.engine",),
    ("rollout.serving",),
    ("rollout.rl",),
    ("rollout.config",),
    ("rollout.llm", "rollout.cli", "rollout"),
    ("trainer_hooks",),
    ("recipes",),
)  # fmt: skip

PACKAGES = ("rollout", "rollout.models", "rollout.weights", "rollout.engine", "rollout.serving",
            "rollout.serving.coordinator", "rollout.rl", "rollout.config", "trainer_hooks",
            "recipes")  # fmt: skip


def module_files() -> dict[str, Path]:
    out = {}
    for top in FIRST_PARTY:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = module_files()


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement except those under `if TYPE_CHECKING:` (never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for branch in node.orelse for n in _runtime_imports(branch))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node)


def _target(name: str) -> str | None:
    """The first-party module that importing `name` executes last (a module, or its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in _runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        names += [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    targets = {_target(n) for n in names if n.split(".")[0] in FIRST_PARTY}
    # importing a submodule always runs its packages first: that edge is Python's, not ours
    return {t for t in targets if t and t != module and not module.startswith(t + ".")}


GRAPH = {m: imports_of(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def test_graph_is_read_from_the_source():
    assert "rollout.engine.engine" in GRAPH["rollout.serving.worker"] or any(
        t.startswith("rollout.engine") for t in GRAPH["rollout.serving.worker"]
    )
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_imports_only_go_down_the_layers():
    upward = sorted(
        f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets if layer_of(t) > layer_of(m)
    )
    assert upward == []


def test_the_library_never_imports_recipes():
    assert [m for m, ts in GRAPH.items() if m.startswith("rollout") and "recipes" in str(ts)] == []


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_alone(package):
    probe = f"import {package}, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_coordinator_process_does_not_load_torch():
    """The coordinator routes msgpack frames; loading torch would cost it ~1 s and ~300 MB."""
    probe = "import rollout.serving.coordinator, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
