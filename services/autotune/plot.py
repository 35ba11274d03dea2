"""Draw a model's tuning history: speed of each measured plan (top) and its bucket layout (bottom)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

MIB = 1024.0**2


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` with a headless backend; SystemExit naming the extra when it is absent."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'bagua-lightning[demo]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_history(model: str, rows: Sequence[dict[str, Any]], output: Path) -> None:
    """Write a PNG: samples/s per measured plan, and each plan's buckets stacked in MiB.

    Args:
        model: the model's name (title).
        rows: one dict per measured plan, oldest first, with ``index``, ``speed``,
            ``plan_version`` and ``bucket_bytes``.
        output: the PNG to write.
    """
    plt = require_matplotlib()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [1, 1.2]})
    x = [int(r["index"]) for r in rows]
    top.plot(x, [float(r["speed"]) for r in rows], marker="o", color="tab:blue")
    best = max(range(len(rows)), key=lambda i: float(rows[i]["speed"]))
    top.scatter([x[best]], [rows[best]["speed"]], s=120, facecolors="none", edgecolors="tab:red", zorder=3,
                label=f"best: plan v{rows[best]['plan_version']}")
    top.set_ylabel("samples/s per rank")
    top.set_title(f"autotune history of {model[:80]}")
    top.grid(alpha=0.3)
    top.legend(loc="lower right")
    for xi, r in zip(x, rows, strict=True):
        bottom_mib = 0.0
        for j, b in enumerate(r["bucket_bytes"]):
            height = b / MIB
            bottom.bar(xi, height, bottom=bottom_mib, width=0.7, color=f"C{j % 10}", edgecolor="white",
                       linewidth=0.3)
            bottom_mib += height
    bottom.set_ylabel("buckets, MiB (stacked in order)")
    bottom.set_xlabel("measured plan (sample #)")
    bottom.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
