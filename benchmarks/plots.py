"""What the side-by-side benchmarks share: their results as JSON next to a plot, and the plot
itself, two bars per row (ours vs the other side) with the ratio written above each pair."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def save(results: dict, out: Path, plot: Callable[[dict, Path], None]) -> None:
    """`out`.json and `out`.png (drawn by `plot`); says where they went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only: a benchmark machine has no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def side_by_side(
    path: Path,
    labels: Sequence[str],
    left: tuple[str, Sequence[float]],
    right: tuple[str, Sequence[float]],
    notes: Sequence[str],
    *,
    ylabel: str,
    title: str,
    figsize: tuple[float, float],
    fontsize: float | None = None,
) -> None:
    """A bar chart of (name, values) pairs, one pair per label, `notes` (the ratios) above."""
    plt = pyplot()
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=figsize)
    ax.bar([i - 0.2 for i in x], left[1], 0.4, label=left[0])
    ax.bar([i + 0.2 for i in x], right[1], 0.4, label=right[0])
    for i, note in enumerate(notes):
        ax.text(i, max(left[1][i], right[1][i]), note, ha="center", va="bottom")
    ax.set_xticks(list(x), labels, **({"fontsize": fontsize} if fontsize else {}))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
