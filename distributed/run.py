"""``python -m bagua_lightning.distributed.run``: Bagua's ``bagua.distributed.run``, torchrun with Bagua's flags.

Every torchrun flag works as in ``torchrun``; Bagua's own become the variables its API reads:
``--bagua_service_port`` (``BAGUA_SERVICE_PORT``), ``--default_bucket_size``
(``BAGUA_DEFAULT_BUCKET_SIZE``), ``--autotune_level`` and the ``--autotune_*`` flags (``BAGUA_AUTOTUNE``,
``BAGUA_AUTOTUNE_*``; the service itself is ``bagua-lightning autotune serve``), ``--report_metrics``
(``BAGUA_REPORT_METRICS``). ``--autotune_log_file``, ``--host_list``, ``--ssh_port`` and
``--enable_bagua_net`` are accepted and ignored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torch.distributed import run as torchrun

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse torchrun's and Bagua's flags, export Bagua's as variables, run torchrun."""
    parser = torchrun.get_args_parser()
    parser.prog = "python -m bagua_lightning.distributed.run"
    parser.add_argument("--bagua_service_port", "--bagua-service-port", dest="bagua_service_port", type=int,
                        default=None)
    parser.add_argument("--default_bucket_size", "--default-bucket-size", dest="default_bucket_size", type=int,
                        default=None)
    parser.add_argument("--autotune_level", "--autotune-level", dest="autotune_level", type=int, default=0)
    parser.add_argument("--autotune_max_samples", dest="autotune_max_samples", type=int, default=None)
    parser.add_argument("--autotune_sampling_confidence_time", dest="autotune_sampling_confidence_time",
                        type=float, default=None)
    parser.add_argument("--autotune_warmup_time", dest="autotune_warmup_time", type=float, default=None)
    parser.add_argument("--report_metrics", dest="report_metrics", action="store_true")
    for ignored in ("--autotune_log_file", "--host_list"):
        parser.add_argument(ignored, default=None)
    parser.add_argument("--ssh_port", type=int, default=None)
    parser.add_argument("--enable_bagua_net", action="store_true")
    args = parser.parse_args(argv)
    if args.bagua_service_port is not None:
        if not 1 <= args.bagua_service_port <= 65535:
            parser.error(f"--bagua_service_port must be a port in 1..65535, got {args.bagua_service_port}")
        os.environ["BAGUA_SERVICE_PORT"] = str(args.bagua_service_port)
    if args.default_bucket_size is not None:
        os.environ["BAGUA_DEFAULT_BUCKET_SIZE"] = str(args.default_bucket_size)
    if args.autotune_level > 0:
        os.environ["BAGUA_AUTOTUNE"] = str(args.autotune_level)
    for flag, var in (("autotune_max_samples", "BAGUA_AUTOTUNE_MAX_SAMPLES"),
                      ("autotune_sampling_confidence_time", "BAGUA_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S"),
                      ("autotune_warmup_time", "BAGUA_AUTOTUNE_WARMUP_TIME_S")):
        if getattr(args, flag) is not None:
            os.environ[var] = str(getattr(args, flag))
    if args.report_metrics:
        os.environ["BAGUA_REPORT_METRICS"] = "1"
    torchrun.run(args)


if __name__ == "__main__":
    main()
