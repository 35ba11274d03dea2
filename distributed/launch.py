"""``python -m bagua_lightning.distributed.launch``: Bagua's launcher flags, run by torchrun.

Bagua's ``python -m bagua.distributed.launch --nproc_per_node=8 train.py ARGS`` becomes
``python -m bagua_lightning.distributed.launch --nproc_per_node=8 train.py ARGS``: the same flags (dashes
or underscores), mapped onto ``torch.distributed.run`` (torchrun), which then replaces this process.

==========================================  ==========================================================
Bagua flag                                  here
==========================================  ==========================================================
``--nnodes``, ``--node_rank``,              the torchrun flags of the same name (static rendezvous
``--nproc_per_node``, ``--master_addr``,    at ``master_addr:master_port``, as Bagua's launcher)
``--master_port``
``-m/--module``, ``--no_python``            the same torchrun flags
``--logdir DIR``                            ``--log-dir DIR --redirects 3`` (torchrun's per-rank files)
``--set_additional_flag``                   each script gets ``--local_rank=N`` before its arguments
``--bagua_service_port``                    ``BAGUA_SERVICE_PORT`` (Bagua's variable; ``get_bagua_service_port``)
``--default_bucket_size``                   ``BAGUA_DEFAULT_BUCKET_SIZE``
``--autotune_level``, ``--autotune_*``,     ``BAGUA_AUTOTUNE`` and Bagua's ``BAGUA_AUTOTUNE_*`` variables;
``--report_metrics``                        the autotune service is not started here: run
                                            ``bagua-lightning autotune serve`` (or ``bagua-lightning up``)
``--host_list``, ``--ssh_port``,            accepted and ignored (Bagua used them for level-2 system
``--autotune_log_file``                     tuning over SSH)
==========================================  ==========================================================

Every rank also gets ``LOCAL_SIZE`` (Bagua's name for the ranks per node) besides torchrun's variables.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["LaunchPlan", "main", "parse_args", "plan"]

# argparse's REMAINDER keeps everything after the script for the script itself.
_REMAINDER = argparse.REMAINDER


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: object) -> None:
    """Add ``--name`` under Bagua's underscore spelling and torchrun's dashed one."""
    dashed = name.replace("_", "-")
    names = [f"--{name}"] + ([f"--{dashed}"] if dashed != name else [])
    parser.add_argument(*names, dest=name, **kwargs)  # type: ignore[arg-type]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bagua_lightning.distributed.launch",
        description="Start one process per rank with Bagua's launcher flags (run by torchrun).")
    _flag(p, "nnodes", type=int, default=1, help="number of nodes (default 1)")
    _flag(p, "node_rank", type=int, default=0, help="this node's index (default 0)")
    _flag(p, "nproc_per_node", type=int, default=1, help="processes on this node (default 1)")
    _flag(p, "master_addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    _flag(p, "master_port", type=int, default=29500, help="free port on node 0 (default 29500)")
    _flag(p, "bagua_service_port", type=int, default=29501, help="sets BAGUA_SERVICE_PORT (default 29501)")
    _flag(p, "set_additional_flag", action="store_true", help="pass --local_rank=N to the script")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    _flag(p, "no_python", action="store_true", help="run the script directly, not with python")
    _flag(p, "logdir", default=None, help="write each rank's stdout/stderr under this directory")
    _flag(p, "autotune_level", type=int, default=0, help="sets BAGUA_AUTOTUNE (0: off)")
    _flag(p, "autotune_log_file", default=None, help="accepted, ignored")
    _flag(p, "report_metrics", action="store_true", help="sets BAGUA_REPORT_METRICS=1")
    _flag(p, "autotune_max_samples", type=int, default=60)
    _flag(p, "autotune_sampling_confidence_time", type=float, default=5.0)
    _flag(p, "autotune_warmup_time", type=float, default=30.0)
    _flag(p, "default_bucket_size", type=int, default=10 * 1024**2, help="sets BAGUA_DEFAULT_BUCKET_SIZE")
    _flag(p, "host_list", default=None, help="accepted, ignored")
    _flag(p, "ssh_port", type=int, default=None, help="accepted, ignored")
    p.add_argument("training_script", help="the training script (or module with -m)")
    p.add_argument("training_script_args", nargs=_REMAINDER, help="its arguments")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Bagua's launcher flags; exits with argparse's one-line usage error on a bad one."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("nnodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node_rank must be in [0, {args.nnodes}) for --nnodes {args.nnodes}, got {args.node_rank}")
    for name in ("master_port", "bagua_service_port"):
        if not 1 <= getattr(args, name) <= 65535:
            parser.error(f"--{name} must be a port in 1..65535, got {getattr(args, name)}")
    if args.module and args.no_python:
        parser.error("--module and --no_python cannot be used together")
    if args.autotune_level < 0:
        parser.error(f"--autotune_level must be >= 0, got {args.autotune_level}")
    return args


@dataclass(frozen=True)
class LaunchPlan:
    """What to run: torchrun's arguments (after ``python -m torch.distributed.run``) and the variables added."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def plan(args: argparse.Namespace) -> LaunchPlan:
    """The torchrun command line and environment that carry out Bagua's ``args``."""
    argv = [f"--nnodes={args.nnodes}", f"--node_rank={args.node_rank}",
            f"--nproc_per_node={args.nproc_per_node}", f"--master_addr={args.master_addr}",
            f"--master_port={args.master_port}"]
    if args.logdir:
        argv += [f"--log-dir={args.logdir}", "--redirects=3"]
    script, script_args = args.training_script, list(args.training_script_args)
    if args.set_additional_flag:
        # torchrun passes no per-rank argument: a shim adds --local_rank=N (from LOCAL_RANK), then runs the script.
        mode = "--exec" if args.no_python else "--module" if args.module else "--script"
        argv += ["--module", "bagua_lightning.distributed._local_rank", mode, script, *script_args]
    else:
        if args.module:
            argv.append("--module")
        if args.no_python:
            argv.append("--no-python")
        argv += [script, *script_args]
    env = {
        "BAGUA_SERVICE_PORT": str(args.bagua_service_port),
        "BAGUA_DEFAULT_BUCKET_SIZE": str(args.default_bucket_size),
        "LOCAL_SIZE": str(args.nproc_per_node),
        "AUTO_TUNE_SERVER_ADDR": f"{args.master_addr}:{args.bagua_service_port}",
    }
    if args.autotune_level > 0:
        env.update(BAGUA_AUTOTUNE=str(args.autotune_level),
                   BAGUA_AUTOTUNE_MAX_SAMPLES=str(args.autotune_max_samples),
                   BAGUA_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S=str(args.autotune_sampling_confidence_time),
                   BAGUA_AUTOTUNE_WARMUP_TIME_S=str(args.autotune_warmup_time))
    if args.report_metrics:
        env["BAGUA_REPORT_METRICS"] = "1"
    return LaunchPlan(argv, env)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse Bagua's flags and replace this process with torchrun."""
    args = parse_args(argv)
    what = plan(args)
    if args.autotune_level > 0:
        print("bagua_lightning.distributed.launch: autotuning needs the service running: "
              "`bagua-lightning autotune serve` (or `bagua-lightning up`)", file=sys.stderr)
    if args.logdir:
        os.makedirs(args.logdir, exist_ok=True)
    env = {**os.environ, **what.env}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "torch.distributed.run", *what.argv], env)


if __name__ == "__main__":
    main()
