"""Fixtures: a real cluster (Redis + prefill + decode processes) per KV transfer backend."""

from __future__ import annotations

import pytest

from tests.cluster import Cluster


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def cluster(request):
    cluster = Cluster(kv_backend=request.param)
    try:
        cluster.start("prefill", wait=False)
        cluster.start("decode", wait=False)
        cluster.wait_all_registered()
        yield cluster
    finally:
        cluster.stop()
