"""The generated gRPC stubs are exactly what the .proto files produce (no stale stubs)."""

from __future__ import annotations

from pathlib import Path

from proto.build import REPO_ROOT, generate, proto_files


def test_generated_stubs_match_the_proto_files(tmp_path: Path):
    generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*"))
    assert {str(p) for p in fresh} >= {
        "pdserve/v1/generation_pb2.py",
        "pdserve/v1/generation_pb2_grpc.py",
        "pdserve/worker/v1/worker_pb2.py",
        "pdserve/worker/v1/worker_pb2_grpc.py",
    }
    stale = [str(p) for p in fresh if (REPO_ROOT / p).read_bytes() != (tmp_path / p).read_bytes()]
    assert not stale, f"regenerate with `make proto`: {stale} differ from {proto_files()}"


def test_every_service_is_importable_from_the_stubs():
    from pdserve.v1 import generation_pb2
    from pdserve.worker.v1 import worker_pb2

    assert set(generation_pb2.DESCRIPTOR.services_by_name) == {"Generation"}
    assert set(worker_pb2.DESCRIPTOR.services_by_name) == {"Prefill", "Decode"}
