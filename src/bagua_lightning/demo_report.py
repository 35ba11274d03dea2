"""What a demo job measured, as JSON, text and a PNG plot; no torch, so the CLI can read it cheaply.

A job (:mod:`bagua_lightning.examples.demo`) fills a :class:`JobResult` on rank 0 and writes it as
``OUT/<job>.json``; :func:`format_job` prints it, :func:`format_comparison` relates several jobs of one
run (did the second job's first epoch read the cache from its first sample?), and :func:`plot_trajectory`
draws the autotune trajectory of all of them into one PNG.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

WARM_HIT_RATE = 0.95  # an epoch below this cache hit rate is still warming the cache
MIB = 1024**2
DATASET_NAME = "bagua-lightning-demo"  # the demo dataset's cache name


@dataclass(kw_only=True, slots=True)
class EpochRecord:
    """One training epoch, summed over all ranks.

    Attributes:
        epoch: 1-based epoch number.
        samples: training samples processed by all ranks.
        seconds: wall time of the epoch (the slowest rank), in seconds.
        hits: samples read from the cache.
        misses: samples computed by the source dataset (then cached).
        loss: mean training loss over the epoch's batches (all ranks).
    """

    epoch: int
    samples: int
    seconds: float
    hits: int
    misses: int
    loss: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass(kw_only=True, slots=True)
class PlanRecord:
    """A bucket plan the job trained with, from the step it was first used.

    Attributes:
        step: first ``global_step`` that communicated with it.
        version: the service's plan version (-1: the strategy's own default plan).
        bucket_size: the size the buckets were cut with, in bytes.
        bucket_bytes: bytes of each bucket, in communication order.
        tensors: parameter names of each bucket.
        hierarchical: intra-node reduction first.
    """

    step: int
    version: int
    bucket_size: int
    bucket_bytes: list[int]
    tensors: list[list[str]]
    hierarchical: bool


@dataclass(kw_only=True, slots=True)
class ReportRecord:
    """One autotune step boundary (the ``autotune/*`` metrics the strategy logs).

    Attributes:
        step: ``global_step`` of the boundary (0: set-up).
        samples_per_s: samples/s per rank over the interval that ended here (the mean over the job's
            ranks); None at set-up. Multiply by the processes for the job's samples/s (the table's unit).
        plan_version: the plan in use from this step on (-1: the default plan).
        bucket_size: its bucket size, in bytes.
        num_buckets: its number of buckets.
        completed: whether the service finished tuning.
    """

    step: int
    samples_per_s: float | None
    plan_version: int
    bucket_size: int
    num_buckets: int
    completed: bool


@dataclass(kw_only=True, slots=True)
class JobResult:
    """Everything one job measured (written by rank 0).

    Attributes:
        job: the job's name (``job1``...).
        processes: training processes (ranks).
        accelerator: ``"cpu"`` or ``"gpu"``.
        backend: ``"gloo"`` or ``"nccl"``.
        algorithm: the Bagua algorithm.
        autotune_service: ``host:port`` of the autotune service.
        cache: the Redis store the dataset used.
        dataset: name, version, size and transform settings of the dataset.
        batch_size: samples per batch and rank.
        epochs: one record per epoch.
        first_batch_hits: samples of the first batch of every rank that came from the cache (summed).
        first_batch_samples: samples in those first batches (summed); 0 when not observed.
        plans: the bucket plans used, in order.
        reports: the autotune step boundaries, in order.
        autotune_summary: the strategy's one-line autotune summary.
        seconds: wall time of the whole fit, in seconds.
    """

    job: str
    processes: int
    accelerator: str
    backend: str
    algorithm: str
    autotune_service: str
    cache: str
    dataset: dict[str, Any]
    batch_size: int
    epochs: list[EpochRecord] = field(default_factory=list)
    first_batch_hits: int = 0
    first_batch_samples: int = 0
    plans: list[PlanRecord] = field(default_factory=list)
    reports: list[ReportRecord] = field(default_factory=list)
    autotune_summary: str = ""
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        """Optimizer steps of the fit (the last step a plan or report refers to, at least)."""
        batches = sum(math.ceil(e.samples / (self.processes * self.batch_size)) for e in self.epochs)
        return max([batches, *(p.step for p in self.plans), *(r.step for r in self.reports)])

    @property
    def first_sample_cached(self) -> bool:
        """True when every rank's first batch came entirely from the cache."""
        return self.first_batch_samples > 0 and self.first_batch_hits == self.first_batch_samples

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobResult:
        data = dict(data)
        data["epochs"] = [EpochRecord(**e) for e in data.get("epochs", [])]
        data["plans"] = [PlanRecord(**p) for p in data.get("plans", [])]
        data["reports"] = [ReportRecord(**r) for r in data.get("reports", [])]
        return cls(**data)

    def write(self, folder: Path) -> Path:
        path = folder / f"{self.job}.json"
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path


def load_job(path: Path) -> JobResult:
    """Read a job's JSON; ``ValueError`` naming the file when it is not one."""
    try:
        return JobResult.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path} is not a demo job result ({exc}); run the job again") from exc


# ------------------------------------------------------------------------------------------------ text


def _mib(n: float) -> str:
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{int(n)} B"


def _plan_line(p: PlanRecord) -> str:
    source = f"service plan v{p.version}" if p.version >= 0 else "default plan"
    sizes = ", ".join(_mib(b) for b in p.bucket_bytes)
    return (f"step {p.step:>4}: {source}, cut at {_mib(p.bucket_size)} -> {len(p.bucket_bytes)} bucket(s) "
            f"[{sizes}]{', hierarchical' if p.hierarchical else ''}")


def format_job(job: JobResult) -> str:
    """The job's summary: per-epoch throughput and cache hit rate, the bucket plans and how they changed."""
    ds = job.dataset
    lines = [
        f"== {job.job}: {job.processes} processes ({job.accelerator}, {job.backend}), {job.algorithm}, "
        f"{job.steps} steps in {job.seconds:.1f} s",
        f"   dataset {ds.get('name')}:{ds.get('version')}: {ds.get('samples')} samples, "
        f"{ds.get('transform_ms')} ms slow transform each",
        f"   cache: {job.cache}; autotune service: {job.autotune_service}",
        "   epoch   samples/s   cache hit rate   hits / misses   mean loss",
    ]
    for e in job.epochs:
        lines.append(f"   {e.epoch:>5}   {e.samples_per_s:>9.1f}   {100 * e.hit_rate:>13.1f}%   "
                     f"{e.hits:>5} / {e.misses:<6}   {e.loss:>9.4f}")
    if job.first_batch_samples:
        where = ("from the cache (hit)" if job.first_sample_cached else
                 "computed by the slow transform (miss)" if job.first_batch_hits == 0 else "partly cached")
        lines.append(f"   first sample: {where}; first batch of every rank: {job.first_batch_hits}/"
                     f"{job.first_batch_samples} samples from the cache")
    lines.append(f"   bucket plans ({len(job.plans)} used, {max(len(job.plans) - 1, 0)} change(s)):")
    lines += [f"     {_plan_line(p)}" for p in job.plans]
    if job.plans:
        final = job.plans[-1]
        lines.append("   final plan, tensors per bucket:")
        lines += [f"     bucket {i}: {', '.join(names)}" for i, names in enumerate(final.tensors)]
    speeds = [r for r in job.reports if r.samples_per_s is not None]
    if speeds:
        lines.append(f"   autotune reports: {len(speeds)} (samples/s of all ranks, as in the table: "
                     + ", ".join(f"{(r.samples_per_s or 0.0) * job.processes:.0f}" for r in speeds[:12])
                     + (", ..." if len(speeds) > 12 else "") + ")")
    warm = [e.epoch for e in job.epochs if e.hit_rate < WARM_HIT_RATE]
    if warm and len(warm) < len(job.epochs):
        lines.append(f"   note: epoch(s) {', '.join(map(str, warm))} read a cold cache (hit rate below "
                     f"{100 * WARM_HIT_RATE:.0f}%); their throughput reflects the slow transform, not the bucket "
                     "plan: compare plans within warm epochs")
    if job.autotune_summary:
        lines.append(f"   {job.autotune_summary}")
    return "\n".join(lines)


def format_comparison(jobs: list[JobResult]) -> str:
    """How the later jobs of one run profited from the first: cache from the first sample, plans."""
    if len(jobs) < 2:
        return ""
    first, lines = jobs[0], ["== across jobs"]
    for later in jobs[1:]:
        if not later.epochs:
            continue
        e = later.epochs[0]
        if later.first_sample_cached:
            lines.append(f"   {later.job}, epoch 1: the cache served it from the first sample on "
                         f"(first batches {later.first_batch_hits}/{later.first_batch_samples} hits, "
                         f"epoch hit rate {100 * e.hit_rate:.1f}%): {first.job} had computed the samples")
        else:
            lines.append(f"   {later.job}, epoch 1: first sample NOT from the cache (first batches "
                         f"{later.first_batch_hits}/{later.first_batch_samples} hits, epoch hit rate "
                         f"{100 * e.hit_rate:.1f}%)")
        if first.epochs and first.epochs[0].samples_per_s > 0:
            ratio = e.samples_per_s / first.epochs[0].samples_per_s
            lines.append(f"   epoch 1 samples/s: {first.job} {first.epochs[0].samples_per_s:.1f} -> "
                         f"{later.job} {e.samples_per_s:.1f} ({ratio:.2f}x; the cache's effect: {first.job} "
                         f"epoch 1 computed its samples, {later.job} read them)")
        if first.plans and later.plans:
            lines.append(f"   {later.job} started on {_plan_line(later.plans[0]).split(': ', 1)[1]} "
                         f"({first.job} ended on v{first.plans[-1].version})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ plot


def plot_trajectory(jobs: list[JobResult], path: Path) -> Path:
    """Draw every job's autotune trajectory into one PNG: samples/s and the bucket size per step.

    Jobs follow each other on the step axis (a dashed line where the next one starts); epoch
    boundaries are dotted lines, and epochs that read a cold cache are shaded, so a reader does
    not take the cache warming up for tuning. Speeds are samples/s of all ranks, the table's unit.
    """
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the demo's plot needs matplotlib: pip install 'bagua-lightning[demo]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, (ax_speed, ax_size) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, constrained_layout=True)
    offset = 0
    total = max(sum(max(job.steps, 1) for job in jobs), 1)
    placed: list[tuple[int, float, int]] = []  # (step, MiB, label offset) of the labels drawn so far
    last_version: int | None = None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, job in enumerate(jobs):
        color = colors[i % len(colors)]
        speeds = [(offset + r.step, r.samples_per_s * job.processes) for r in job.reports
                  if r.samples_per_s is not None]
        if speeds:
            xs, ys = zip(*speeds, strict=True)
            ax_speed.plot(xs, ys, "o-", color=color, label=f"{job.job}: samples/s (all ranks) per report")
        step = offset
        for e in job.epochs:
            start = step
            step += math.ceil(e.samples / max(1, job.processes * job.batch_size))
            if e.hit_rate < WARM_HIT_RATE:
                for ax in (ax_speed, ax_size):
                    ax.axvspan(start, step, color="orange", alpha=0.12, linewidth=0)
                ax_speed.annotate(f"cache warming ({100 * e.hit_rate:.0f}% hits)", (start, 1),
                                  xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                                  fontsize=7, color="darkorange")
            if e is not job.epochs[-1]:
                for ax in (ax_speed, ax_size):
                    ax.axvline(step, color="gray", linestyle=":", linewidth=0.7)
                ax_size.annotate(f"epoch {e.epoch + 1}", (step, 0), xycoords=("data", "axes fraction"),
                                 xytext=(2, 2), textcoords="offset points", fontsize=7, color="gray")
        steps = [offset + p.step for p in job.plans]
        sizes = [p.bucket_size / MIB for p in job.plans]
        end = offset + max(job.steps, 1)
        if steps:
            ax_size.step([*steps, end], [*sizes, sizes[-1]], where="post", color=color,
                         label=f"{job.job}: bucket size in use")
            for x, p in zip(steps, job.plans, strict=True):
                if p.version == last_version:
                    continue  # a job that starts on the plan the previous one ended on
                # Labels of plans a few steps apart at similar sizes would print over each other.
                size = p.bucket_size / MIB
                dy = next((d for d in (4, -10, 14, -20) if not any(
                    abs(x - px) < 0.12 * total and abs(math.log(size / ps)) < 0.2 and d == pd
                    for px, ps, pd in placed)), 4)
                ax_size.annotate(f"v{p.version}: {len(p.bucket_bytes)} buckets", (x, size),
                                 textcoords="offset points", xytext=(2, dy), fontsize=7, color=color)
                placed.append((x, size, dy))
                last_version = p.version
        if i:
            for ax in (ax_speed, ax_size):
                ax.axvline(offset, color="gray", linestyle="--", linewidth=0.8)
            ax_speed.annotate(f"{job.job} starts", (offset, 0), xycoords=("data", "axes fraction"),
                              xytext=(3, 3), textcoords="offset points", fontsize=8, color="gray")
        offset = end
    ax_speed.set_ylabel("samples/s (all ranks)")
    ax_speed.set_title("bagua-lightning demo: autotune trajectory")
    ax_size.set_ylabel("bucket size (MiB)")
    ax_size.set_yscale("log")
    ax_size.margins(y=0.15)
    ax_size.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax_size.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax_size.set_xlabel("training step (jobs one after another)")
    for ax in (ax_speed, ax_size):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
