"""Small matplotlib helpers every stage shares: a figure is saved as a PNG in the run directory and shown inline.

Why here: headless runs (papermill, pytest, a script) must never need a display, and a notebook must show the same
figure it saved. `figure()` picks the Agg backend when no IPython kernel is running; `save_show()` writes the PNG
(atomically) and then shows the figure in a notebook or closes it elsewhere, so loops of figures do not leak memory.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from eagle3lib.common.atomic import atomic_path


def in_notebook() -> bool:
    """True inside a Jupyter/papermill kernel (figures are shown inline there)."""
    return "ipykernel" in sys.modules


def figure(*args: Any, **kwargs: Any):
    """`plt.subplots(...)` with a headless-safe backend: returns (fig, axes)."""
    import matplotlib

    if not in_notebook():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def integer_ticks(ax: Any, axis: str = "x") -> None:
    """Ticks at whole numbers only, on an axis that counts (positions, tokens, k, steps): matplotlib's default puts
    them at 0.5 steps on a short range."""
    from matplotlib.ticker import MaxNLocator

    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))


def save(fig, path: str | Path) -> Path:
    """Write `fig` to `path` (PNG, dpi 110, tight) atomically: a killed run never leaves half a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    return path


def save_show(fig, path: str | Path) -> Path:
    """`save`, then show the figure inline (notebook) or close it."""
    import matplotlib.pyplot as plt

    path = save(fig, path)
    if in_notebook():
        plt.show()
    plt.close(fig)
    return path
