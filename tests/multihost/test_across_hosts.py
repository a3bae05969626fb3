"""A request through the router with the router, Redis, the prefill and the decode worker each
on its own host: the KV crosses a real link (tcp, or NIXL over UCX's tcp transport), every
address is the one a worker advertised, and the tokens are the single-process engine's."""

from __future__ import annotations

import pytest

from tests.multihost.conftest import cluster_on_hosts, generate, greedy_tokens, token_ids
from tests.workers.calls import LONG_PROMPT


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def hosts(request):
    with cluster_on_hosts(request.param, num_prefill=1, num_decode=1) as hosts:
        yield hosts


def test_greedy_requests_cross_hosts_with_the_engines_tokens(hosts, llm):
    (prefill,), (decode,) = hosts.live("prefill"), hosts.live("decode")
    # Each advertises its own host's address: the router and the decode worker reach it there.
    assert prefill.address.startswith(f"{prefill.host.address}:")
    assert decode.address.startswith(f"{decode.host.address}:")
    prompts = ["The capital of France is", LONG_PROMPT]  # the long one: three chunks shipped
    for prompt, expected in zip(prompts, greedy_tokens(llm, prompts, 8), strict=True):
        messages = generate(hosts.router, prompt, max_tokens=8)
        assert token_ids(messages) == expected
        assert messages[-1].finish_reason == "length"
    backend = hosts.cluster.kv_backend
    sent = prefill.metric("pdserve_kv_transfer_bytes_total", backend=backend, direction="sent")
    received = decode.metric(
        "pdserve_kv_transfer_bytes_total", backend=backend, direction="received"
    )
    assert sent == received > 0
    hosts.cluster.assert_idle(prefill, decode)
