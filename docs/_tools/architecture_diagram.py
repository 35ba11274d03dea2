"""Draw the architecture diagram of the README and the docs' front page: ``docs/_static/architecture.png``.

    python docs/_tools/architecture_diagram.py [--out docs/_static/architecture.png]

The same picture as the ASCII one in docs/architecture.md ("One picture"), drawn with matplotlib so that a
change to it is a change to this file. Needs matplotlib (the ``demo`` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "_static" / "architecture.png"

TRAINER = "#e8f0fe"
ENGINE = "#d2e3fc"
SERVICE = "#fef7e0"
REDIS = "#fce8e6"
EDGE = "#3c4043"


def draw(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(10, 6), dpi=150)
    ax.set_xlim(0, 100)
    ax.set_ylim(-4, 56)
    ax.axis("off")

    def box(x: float, y: float, w: float, h: float, color: str, title: str, lines: tuple[str, ...] = (),
            size: float = 9.5) -> None:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.4,rounding_size=1.2", fc=color, ec=EDGE,
                                    lw=1.1))
        ax.text(x + w / 2, y + h - 2.2, title, ha="center", va="top", fontsize=size + 0.5, weight="bold")
        for i, line in enumerate(lines):
            ax.text(x + w / 2, y + h - 5.6 - 3.1 * i, line, ha="center", va="top", fontsize=size - 1.3,
                    family="DejaVu Sans Mono")

    def arrow(x0: float, y0: float, x1: float, y1: float, label: str, dx: float = 0.0) -> None:
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="<|-|>", mutation_scale=12, lw=1.2,
                                     color=EDGE))
        ax.text((x0 + x1) / 2 + dx, (y0 + y1) / 2, label, ha="left", va="center", fontsize=8, style="italic")

    # The training job: N ranks, two front doors onto one engine.
    ax.add_patch(FancyBboxPatch((1, 24), 98, 31, boxstyle="round,pad=0.4,rounding_size=1.5", fc="white",
                                ec=EDGE, lw=1.3, ls="--"))
    ax.text(3, 53.6, "training job: N ranks (torch.distributed: NCCL on GPU, Gloo on CPU)", fontsize=9.5,
            va="top", weight="bold")
    box(3, 39, 45, 11, TRAINER, "Lightning front door", ("Trainer(strategy=BaguaStrategy(", "  algorithm=..., autotune=True))"))
    box(52, 39, 45, 11, TRAINER, "Bagua's API (torch_api)", ("import bagua_lightning.torch_api as bagua",
                                                            "model.with_bagua([opt], ByteGradAlgorithm())"))
    box(3, 26, 60, 10, ENGINE, "engine: algorithms, buckets, compression",
        ("gradient buckets cut by a BucketPlan; per-bucket timings;", "all ranks switch plans at the same step"))
    box(67, 26, 30, 10, ENGINE, "sample cache client", ("DataLoader(CachedDataset)", "-> CacheLoader -> RedisStore"))
    ax.add_patch(FancyArrowPatch((25, 39), (25, 36.6), arrowstyle="-|>", mutation_scale=10, color=EDGE))
    ax.add_patch(FancyArrowPatch((60, 39), (45, 36.6), arrowstyle="-|>", mutation_scale=10, color=EDGE))

    # The services.
    box(3, 2, 45, 14, SERVICE, "autotune service (no torch)",
        ("servicer -> session per model", "model-based planner | Bayesian", "best plans persisted"))
    box(52, 2, 45, 14, REDIS, "Redis Cluster: 3 masters + 3 replicas",
        ("samples {dataset}:{version}:{index}", "sealed entries, TLS, read ports", "plans, catalog"))
    arrow(25, 25.4, 25, 16.8, "gRPC: bagua_lightning.autotune.v1", dx=1.2)
    arrow(82, 25.4, 82, 16.8, "RESP: pipelined reads", dx=1.2)
    ax.add_patch(FancyArrowPatch((48.6, 9), (51.4, 9), arrowstyle="-|>", mutation_scale=10, color=EDGE))
    ax.text(50, -1.2, "both started by: bagua-lightning up | docker compose up | Kubernetes manifests | SLURM",
            ha="center", va="top", fontsize=8.5)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the PNG (default: %(default)s)")
    print(draw(parser.parse_args().out))


if __name__ == "__main__":
    main()
