"""Plots of the benchmarks' ratios with their 95 % intervals, drawn from the JSON the benchmarks write.

    python -m benchmarks.plots                 # redraw every plot of docs/benchmarks/results/manifest.json
    python -m benchmarks.plots --out DIR       # somewhere else (default docs/_static/benchmarks/)

``docs/benchmarks/results/`` holds the JSON documents as the benchmarks wrote them (``--json``), and
``manifest.json`` says for each what it measured: its title, the command, the machine and the date. A plot
shows every ratio the document holds with its interval (an entry ``{"ratio": r, "ci95": [low, high]}``,
named by its key or its ``variant``; or a pair ``"x": r`` and ``"x_ci95": [low, high]``), against a line at
1 (the baseline of the same run). The docs page "Benchmarks at a glance" shows each plot under its caption.
Needs matplotlib (the ``demo`` extra).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks" / "results"
MANIFEST = RESULTS / "manifest.json"
DEFAULT_OUT = ROOT / "docs" / "_static" / "benchmarks"
MANIFEST_FIELDS = ("file", "title", "command", "machine", "date")


@dataclass(frozen=True, slots=True)
class Ratio:
    """One measured ratio: ``value`` (> 1: faster than the baseline) and its 95 % interval."""

    label: str
    value: float
    low: float
    high: float


@dataclass(frozen=True, slots=True)
class Result:
    """One entry of the manifest: a JSON document the benchmark wrote, and what it measured."""

    file: str
    title: str
    command: str
    machine: str
    date: str
    baseline: str = "the baseline"

    @property
    def stem(self) -> str:
        return Path(self.file).stem


def load_manifest(path: Path = MANIFEST) -> list[Result]:
    """The manifest's entries; a missing field or file is an error naming it."""
    entries = json.loads(path.read_text())
    results = []
    for index, entry in enumerate(entries):
        missing = [f for f in MANIFEST_FIELDS if not entry.get(f)]
        if missing:
            raise ValueError(f"{path}: entry {index} lacks {missing}; give each of {list(MANIFEST_FIELDS)}")
        if not (path.parent / entry["file"]).is_file():
            raise ValueError(f"{path}: entry {index} names {entry['file']!r}, which is not in {path.parent}")
        results.append(Result(**{k: str(v) for k, v in entry.items()}))
    return results


def ratios(document: Any, prefix: str = "") -> Iterator[Ratio]:
    """Every ratio with an interval in a benchmark's JSON document, in document order."""
    if not isinstance(document, dict):
        return
    for key, value in document.items():
        label = f"{prefix}{key}"
        if isinstance(value, dict):
            if isinstance(value.get("ratio"), int | float) and _interval(value.get("ci95")):
                name = f"{label} (vs {value['variant']})" if "variant" in value else label
                low, high = value["ci95"]
                yield Ratio(name, float(value["ratio"]), float(low), float(high))
            else:
                # "results" groups a run's variants: they keep their own names.
                yield from ratios(value, prefix if key == "results" else f"{label} ")
        elif isinstance(value, int | float) and not isinstance(value, bool) and _interval(document.get(f"{key}_ci95")):
            low, high = document[f"{key}_ci95"]
            yield Ratio(label, float(value), float(low), float(high))


def _interval(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, int | float) for v in value)


def draw(result: Result, out_dir: Path, results_dir: Path = RESULTS) -> Path:
    """Draw ``result``'s ratios into ``out_dir/<stem>.png``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = list(ratios(json.loads((results_dir / result.file).read_text())))
    if not found:
        raise ValueError(f"{result.file} holds no ratio with a 95 % interval (entries {{'ratio', 'ci95'}})")
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(found) + 1.6), dpi=120)
    ys = list(range(len(found)))[::-1]
    for y, r in zip(ys, found, strict=True):
        color = "#1a73e8" if r.low > 1 else "#d93025" if r.high < 1 else "#5f6368"
        ax.errorbar(r.value, y, xerr=[[r.value - r.low], [r.high - r.value]], fmt="o", color=color, capsize=4)
        ax.annotate(f"{r.value:.3f}x [{r.low:.3f}, {r.high:.3f}]", (r.high, y), xytext=(6, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.axvline(1.0, color="#3c4043", lw=1, ls="--")
    ax.set_yticks(ys, [r.label for r in found], fontsize=9)
    left = min(1.0, *(r.low for r in found))
    right = max(1.0, *(r.high for r in found))
    ax.set_xlim(left - 0.05 * (right - left) - 0.02, right + 0.35 * (right - left) + 0.05)
    ax.set_xlabel(f"ratio to {result.baseline} (> 1: faster), median with 95 % bootstrap interval")
    ax.set_title("\n".join(textwrap.wrap(result.title, 70)), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result.stem}.png"
    fig.tight_layout()
    fig.savefig(path, facecolor="white")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Redraw the benchmark plots from their JSON results.")
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: %(default)s")
    args = parser.parse_args(argv)
    for result in load_manifest(args.manifest):
        print(draw(result, args.out, args.manifest.parent))


if __name__ == "__main__":
    main()
