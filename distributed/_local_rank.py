"""Run a training script with ``--local_rank=N`` first among its arguments (Bagua's ``--set_additional_flag``).

``python -m bagua_lightning.distributed._local_rank (--script|--module|--exec) TARGET ARGS...``: ``N`` is
torchrun's ``LOCAL_RANK``; ``--script`` runs a Python file, ``--module`` a module (``python -m``),
``--exec`` a program.
"""

from __future__ import annotations

import os
import runpy
import sys

_USAGE = "usage: python -m bagua_lightning.distributed._local_rank (--script|--module|--exec) TARGET [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    """Run the target as the launcher asked."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("--script", "--module", "--exec"):
        sys.exit(_USAGE)
    mode, target, rest = args[0], args[1], args[2:]
    local_rank = os.environ.get("LOCAL_RANK", "")
    if not local_rank.isdigit():
        sys.exit(f"LOCAL_RANK={local_rank!r} is not a rank; start this through bagua_lightning.distributed.launch")
    target_argv = [target, f"--local_rank={local_rank}", *rest]
    if mode == "--exec":
        os.execvp(target, target_argv)
    sys.argv = target_argv
    if mode == "--module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
