"""Generate (or check) the committed Python stubs for the autotune proto.

    python -m bagua_lightning.proto.codegen          # rewrite the stubs
    python -m bagua_lightning.proto.codegen --check  # exit 1 when they are stale

Stubs are generated with the pinned ``grpcio-tools`` of the ``dev`` extra so
that they load on every grpcio/protobuf runtime the project accepts (newer
generators emit a version guard that refuses older runtimes).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent / "autotune" / "v1"
PROTO_NAME = "autotune.proto"
# Path of the proto inside the import root; generated imports follow it.
IMPORT_PATH = Path("bagua_lightning/proto/autotune/v1")
GENERATED = ("autotune_pb2.py", "autotune_pb2.pyi", "autotune_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc on the proto and write the generated files into ``out_dir``."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover
        raise SystemExit(
            "grpcio-tools is needed to generate stubs: pip install -e '.[dev]'"
        ) from exc
    import importlib.resources

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / IMPORT_PATH
        src.mkdir(parents=True)
        shutil.copy(PROTO_DIR / PROTO_NAME, src / PROTO_NAME)
        well_known = str(importlib.resources.files("grpc_tools") / "_proto")
        rc = protoc.main(
            [
                "protoc",
                f"-I{root}",
                f"-I{well_known}",
                f"--python_out={root}",
                f"--pyi_out={root}",
                f"--grpc_python_out={root}",
                str(IMPORT_PATH / PROTO_NAME),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(src / name, out_dir / name)


def stale_files() -> list[str]:
    """Names of committed stubs that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        return [
            name
            for name in GENERATED
            if not (PROTO_DIR / name).exists()
            or (PROTO_DIR / name).read_bytes() != (fresh / name).read_bytes()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale stubs: {', '.join(stale)}; run python -m bagua_lightning.proto.codegen")
            return 1
        print("stubs are up to date")
        return 0
    generate(PROTO_DIR)
    print(f"wrote {', '.join(GENERATED)} to {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
