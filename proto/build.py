"""Generates the Python gRPC stubs from proto/**/*.proto into the pdserve package tree.

`python -m proto.build` writes pdserve/v1/generation_pb2*.py and pdserve/worker/v1/*; the
generated files are not committed, and tests check they match the .proto files.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    for proto in files:  # make every generated folder an importable package
        package_dir = (out_dir / proto).parent
        while package_dir != out_dir:
            (package_dir / "__init__.py").touch()
            package_dir = package_dir.parent


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
