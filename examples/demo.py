"""The main job: a small model trained on several processes that tunes its own communication and caches samples.

Copy this file to start your own job. One run is one training job:

* :class:`SlowSynthetic` makes 32x32 images of 4 classes whose per-sample transform is deliberately slow
  (a sleep standing in for decoding and augmentation, plus real FFT features);
* :class:`~bagua_lightning.client.CachedDataset` wraps it: samples computed once are stored in Redis under
  ``{dataset_name}:{version}:{index}``, so later epochs, and later jobs with the same name and version, read
  them instead of recomputing them;
* ``Trainer(strategy=BaguaStrategy(autotune=True))`` trains on 2 CPU processes (Gloo), or on every GPU
  (NCCL): rank 0 asks the autotune service for bucket plans every ``autotune_interval`` steps and all ranks
  switch to a new plan at the same step;
* :class:`DemoMonitor` measures samples/s and the cache hit rate per epoch over all ranks, whether the first
  batch came from the cache, and every bucket plan used; :class:`TrajectoryLogger` keeps the ``autotune/*``
  metrics the strategy logs at each step boundary.

At the end rank 0 prints a summary and writes ``OUT/<job>.json`` and ``OUT/<job>.png`` (the autotune
trajectory). The services come from ``bagua-lightning up`` (the services file) or the environment
(``BAGUA_LIGHTNING_AUTOTUNE_SERVICE``, ``BAGUA_LIGHTNING_REDIS_HOSTS``)::

    bagua-lightning up
    python -m bagua_lightning.examples.demo --out demo-out --job job1
    python -m bagua_lightning.examples.demo --out demo-out --job job2   # first epoch: all cache hits

``bagua-lightning demo`` does all of that (and runs the job twice) in one command.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bagua_lightning.core.addresses import format_address
from bagua_lightning.demo_report import (
    DATASET_NAME,
    EpochRecord,
    JobResult,
    PlanRecord,
    ReportRecord,
    format_job,
    plot_trajectory,
)

from ..client import CachedDataset, RedisStore
from ..client.cache import fingerprint
from ..strategy import BaguaStrategy

CLASSES = 4
ALGORITHMS = ("gradient_allreduce", "bytegrad")  # autotune tunes gradient buckets


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """One demo job.

    Attributes:
        out: folder for ``<job>.json`` and ``<job>.png``.
        job: the job's name in the summary and the plot.
        epochs: training epochs.
        samples: dataset size.
        batch_size: samples per batch and process.
        transform_ms: sleep in each sample's transform, in milliseconds (the slow part the cache skips).
        devices: training processes per node; None: every GPU when CUDA is available, else 2 CPU processes.
        nodes: machines the job runs on (Lightning's ``num_nodes``; launch the script on each with
            ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, or use ``torchrun``).
        algorithm: ``gradient_allreduce`` or ``bytegrad``.
        autotune_interval: steps between two autotune step boundaries.
        autotune_service: ``host:port``; None: env, services file, default (see ``BaguaStrategy``).
        dataset_name: cache name of the dataset; jobs with the same name and version share samples.
        workers: DataLoader worker processes per rank (0: load in the training process, which also lets
            the job observe whether its first batch came from the cache).
        seed: seed of the synthetic data and of the model.
        plot: write ``<job>.png``.
    """

    out: Path
    job: str = "job1"
    epochs: int = 8
    samples: int = 4096
    batch_size: int = 32
    transform_ms: float = 3.0
    devices: int | None = None
    nodes: int = 1
    algorithm: str = "gradient_allreduce"
    autotune_interval: int = 8
    autotune_service: str | None = None
    dataset_name: str = DATASET_NAME
    workers: int = 0
    seed: int = 0
    plot: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "samples", "batch_size", "autotune_interval", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.devices is not None and (isinstance(self.devices, bool) or self.devices < 1):
            raise ValueError(f"devices must be a positive number of processes (or None for the default), "
                             f"got {self.devices!r}")
        if not math.isfinite(self.transform_ms) or self.transform_ms < 0:
            raise ValueError(f"transform_ms must be >= 0 milliseconds, got {self.transform_ms!r}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r} has no gradient buckets to tune; use one of "
                             f"{', '.join(ALGORITHMS)}")
        if not self.job or "/" in self.job:
            raise ValueError(f"job must be a non-empty name without '/', got {self.job!r}")

    @property
    def dataset_version(self) -> str:
        """Changes with everything that changes the samples' values (not with the transform's sleep)."""
        return fingerprint("SlowSynthetic", SlowSynthetic.REVISION, self.samples, SlowSynthetic.SIZE, CLASSES,
                           self.seed)


# ------------------------------------------------------------------------------------------------ data


class SlowSynthetic(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Noisy 32x32 gratings of 4 classes; each sample's transform sleeps ``transform_ms`` and computes
    FFT features, like decoding and augmenting a real image would take time."""

    SIZE = 32
    REVISION = 2  # part of the cache version: bump it whenever the transform changes what it returns

    def __init__(self, samples: int, transform_ms: float, seed: int = 0) -> None:
        self.samples, self.transform_ms, self.seed = samples, transform_ms, seed
        axis = torch.linspace(0, 2 * math.pi, self.SIZE)
        self.patterns = torch.stack([torch.sin((k + 1) * axis)[None, :] * torch.cos((k + 1) * axis)[:, None]
                                     for k in range(CLASSES)])

    @classmethod
    def features(cls) -> int:
        return cls.SIZE * cls.SIZE + cls.SIZE * (cls.SIZE // 2 + 1)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % CLASSES
        image = 0.25 * self.patterns[label] + torch.randn(self.SIZE, self.SIZE, generator=g)  # faint signal
        return self.transform(image), torch.tensor(label)

    def transform(self, image: torch.Tensor) -> torch.Tensor:
        time.sleep(self.transform_ms / 1000)
        image = (image - image.mean()) / (image.std() + 1e-6)
        spectrum = torch.fft.rfft2(image).abs().log1p()
        spectrum = (spectrum - spectrum.mean()) / (spectrum.std() + 1e-6)
        return torch.cat([image.reshape(-1), spectrum.reshape(-1)])


class DemoCachedDataset(CachedDataset):
    """A ``CachedDataset`` that remembers how many samples of the first batch it served were cache hits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_batch: tuple[int, int] | None = None  # (hits, samples) of this process's first batch

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        before = self.stats.hits
        values = super().__getitems__(indices)
        if self.first_batch is None:
            self.first_batch = (self.stats.hits - before, len(indices))
        return values


# ------------------------------------------------------------------------------------------------ model


class DemoNet(L.LightningModule):
    """An MLP classifier with 10 parameter tensors (~4.8 M parameters, 19 MB of gradients per step)."""

    def __init__(self, in_features: int, hidden: int = 1024, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, CLASSES))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("loss", loss, prog_bar=True)
        self.log("acc", (logits.argmax(dim=1) == y).float().mean(), prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


# ------------------------------------------------------------------------------------------------ measuring


class TrajectoryLogger(Logger):
    """Keeps the ``autotune/*`` metrics ``BaguaStrategy(autotune=True)`` logs at every step boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[ReportRecord] = []

    @property
    def name(self) -> str:
        return "trajectory"

    @property
    def version(self) -> None:
        return None  # nothing to version (and no ``v_num`` in the progress bar)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "autotune/plan_version" not in metrics:
            return
        speed = metrics.get("autotune/samples_per_s")
        self.reports.append(ReportRecord(
            step=int(step or 0), samples_per_s=None if speed is None else float(speed),
            plan_version=int(metrics["autotune/plan_version"]), bucket_size=int(metrics.get("autotune/bucket_size", 0)),
            num_buckets=int(metrics.get("autotune/num_buckets", 0)), completed=bool(metrics.get("autotune/completed"))))


def _all_reduce(trainer: L.Trainer, values: list[float], op: Any) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
    dist.all_reduce(t, op=op)
    return [float(v) for v in t.cpu().tolist()]


class DemoMonitor(Callback):
    """Per epoch over all ranks: samples/s, cache hits and misses, mean loss; and every bucket plan used.

    The reductions are collectives: every rank runs them at the same epoch ends.
    """

    def __init__(self, dataset: DemoCachedDataset, trajectory: TrajectoryLogger) -> None:
        self.dataset, self.trajectory = dataset, trajectory
        self.epochs: list[EpochRecord] = []
        self.plans: list[PlanRecord] = []
        self.first_batch = (0, 0)  # (hits, samples) summed over the ranks
        self._fingerprint: str | None = None
        self._start = 0.0
        self._hits = self._misses = self._samples = self._batches = 0
        self._loss = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._track_plan(trainer, step=0)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stats = self.dataset.stats
        self._start, self._hits, self._misses = time.monotonic(), stats.hits, stats.misses
        self._samples = self._batches = 0
        self._loss = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._samples += len(batch[1])
        self._batches += 1
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._loss += float(loss.detach())
        self._track_plan(trainer, step=trainer.global_step - 1)  # the plan this step communicated with

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.dataset.flush()  # this epoch's new samples are readable by every rank and every later job
        stats = self.dataset.stats
        first_hits, first_samples = self.dataset.first_batch or (0, 0)
        samples, hits, misses, loss, batches, f_hits, f_samples = _all_reduce(
            trainer, [self._samples, stats.hits - self._hits, stats.misses - self._misses, self._loss,
                      self._batches, first_hits, first_samples], dist.ReduceOp.SUM)
        (seconds,) = _all_reduce(trainer, [time.monotonic() - self._start], dist.ReduceOp.MAX)
        if not self.epochs:
            self.first_batch = (int(f_hits), int(f_samples))
        self.epochs.append(EpochRecord(epoch=len(self.epochs) + 1, samples=int(samples), seconds=seconds,
                                       hits=int(hits), misses=int(misses), loss=loss / max(batches, 1)))
        if not trainer.progress_bar_callback and trainer.is_global_zero:
            # No progress bar (output is not a terminal): one line per epoch instead of its redrawn lines.
            e = self.epochs[-1]
            print(f"epoch {e.epoch}/{trainer.max_epochs}: {int(batches)} batches in {seconds:.1f} s, "
                  f"{e.samples / max(seconds, 1e-9):.1f} samples/s, cache hits {e.hits}/{e.hits + e.misses}, "
                  f"mean loss {e.loss:.4f}", flush=True)

    def _track_plan(self, trainer: L.Trainer, step: int) -> None:
        plan = getattr(trainer.strategy, "bucket_plan", None)
        if plan is None or plan.fingerprint() == self._fingerprint:
            return
        self._fingerprint = plan.fingerprint()
        reports = self.trajectory.reports
        self.plans.append(PlanRecord(
            step=max(step, 0), version=reports[-1].plan_version if reports else plan.version,
            bucket_size=plan.bucket_size, bucket_bytes=list(plan.bucket_bytes), tensors=plan.tensor_names,
            hierarchical=plan.is_hierarchical_reduce))


# ------------------------------------------------------------------------------------------------ the job


def run(cfg: JobConfig) -> JobResult | None:
    """Train once; rank 0 returns what was measured (after printing and writing it), other ranks None."""
    if torch.cuda.is_available():
        accelerator, devices = "gpu", cfg.devices or torch.cuda.device_count()
    else:
        accelerator, devices = "cpu", cfg.devices or 2
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))  # processes share the cores
    dataset = DemoCachedDataset(SlowSynthetic(cfg.samples, cfg.transform_ms, cfg.seed),
                                dataset_name=cfg.dataset_name, version=cfg.dataset_version)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
                        persistent_workers=cfg.workers > 0)
    trajectory = TrajectoryLogger()
    monitor = DemoMonitor(dataset, trajectory)
    strategy = BaguaStrategy(cfg.algorithm, autotune=True, autotune_service=cfg.autotune_service,
                             autotune_interval=cfg.autotune_interval)
    torch.manual_seed(cfg.seed)
    model = DemoNet(SlowSynthetic.features())
    trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, num_nodes=cfg.nodes,
                        max_epochs=cfg.epochs, enable_progress_bar=sys.stdout.isatty(),  # no redraws into a file
                        logger=trajectory, callbacks=[monitor], enable_checkpointing=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(cfg.out))
    started = time.monotonic()
    trainer.fit(model, train_dataloaders=loader)
    if not trainer.is_global_zero:
        return None
    summary = strategy.autotune_summary
    result = JobResult(
        job=cfg.job, processes=trainer.world_size, accelerator=accelerator,
        backend="nccl" if accelerator == "gpu" else "gloo", algorithm=cfg.algorithm,
        autotune_service=summary.service if summary else str(cfg.autotune_service),
        cache=_describe_store(dataset.cache_loader.store),
        dataset={"name": cfg.dataset_name, "version": cfg.dataset_version, "samples": cfg.samples,
                 "transform_ms": cfg.transform_ms},
        batch_size=cfg.batch_size, epochs=monitor.epochs, first_batch_hits=monitor.first_batch[0],
        first_batch_samples=monitor.first_batch[1], plans=monitor.plans, reports=trajectory.reports,
        autotune_summary=summary.line() if summary else "", seconds=time.monotonic() - started)
    cfg.out.mkdir(parents=True, exist_ok=True)
    result.write(cfg.out)
    print(format_job(result), flush=True)
    if cfg.plot:
        print(f"   plot: {plot_trajectory([result], cfg.out / f'{cfg.job}.png')}", flush=True)
    return result


def _describe_store(store: Any) -> str:
    if not isinstance(store, RedisStore):
        return repr(store)
    hosts = ",".join(format_address(host, port) for host, port in store.hosts)
    return f"{'Redis Cluster' if store.is_cluster else 'Redis'} {hosts}"


def build_parser() -> argparse.ArgumentParser:
    d = JobConfig(out=Path("."))
    p = argparse.ArgumentParser(prog="python -m bagua_lightning.examples.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bagua-lightning-demo"), help="output folder (%(default)s)")
    p.add_argument("--job", default=d.job, help="job name (%(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="epochs (%(default)s)")
    p.add_argument("--samples", type=int, default=d.samples, help="dataset size (%(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per process (%(default)s)")
    p.add_argument("--transform-ms", type=float, default=d.transform_ms,
                   help="slow transform per sample, ms (%(default)s)")
    p.add_argument("--devices", type=int, default=None,
                   help="processes per node (default: all GPUs, else 2 on CPU)")
    p.add_argument("--nodes", type=int, default=d.nodes, help="machines, Lightning's num_nodes (%(default)s)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=d.algorithm, help="(%(default)s)")
    p.add_argument("--autotune-interval", type=int, default=d.autotune_interval,
                   help="steps between autotune step boundaries (%(default)s)")
    p.add_argument("--autotune-service", default=None, help="host:port (default: env, services file, default)")
    p.add_argument("--dataset-name", default=d.dataset_name, help="cache name of the dataset (%(default)s)")
    p.add_argument("--workers", type=int, default=d.workers, help="DataLoader workers per process (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(%(default)s)")
    p.add_argument("--no-plot", action="store_true", help="do not write <job>.png")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = JobConfig(out=args.out, job=args.job, epochs=args.epochs, samples=args.samples,
                        batch_size=args.batch_size, transform_ms=args.transform_ms, devices=args.devices,
                        nodes=args.nodes,
                        algorithm=args.algorithm, autotune_interval=args.autotune_interval,
                        autotune_service=args.autotune_service, dataset_name=args.dataset_name,
                        workers=args.workers, seed=args.seed, plot=not args.no_plot)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Lightning's start-up chatter would bury the summary; warnings and errors still show.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (".*does not have many workers.*", ".*smaller than the logging interval.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
