"""Requests through the router with the router, Redis, the prefill and the decode worker each
on its own host: the KV crosses a real link (tcp, or NIXL over UCX's tcp transport), every
address is the one a worker advertised, and the tokens are the single-process engine's; also
after the prefill worker dies mid-transfer and comes back on the same address."""

from __future__ import annotations

from urllib.parse import urlsplit

import grpc
import pytest

from tests.multihost.conftest import (
    CHUNKED_PROMPT,
    WhenTransferring,
    cluster_on_hosts,
    generate,
    greedy_tokens,
    token_ids,
)
from tests.waiting import wait_until
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
    backend = hosts.cluster.kv_backend
    sent = lambda: prefill.metric(  # noqa: E731
        "pdserve_kv_transfer_bytes_total", backend=backend, direction="sent"
    )
    received = lambda: decode.metric(  # noqa: E731
        "pdserve_kv_transfer_bytes_total", backend=backend, direction="received"
    )
    before = sent(), received()
    prompts = ["The capital of France is", LONG_PROMPT]  # the long one: three chunks shipped
    for prompt, expected in zip(prompts, greedy_tokens(llm, prompts, 8), strict=True):
        messages = generate(hosts.router, prompt, max_tokens=8)
        assert token_ids(messages) == expected
        assert messages[-1].finish_reason == "length"
    assert sent() - before[0] == received() - before[1] > 0  # the KV crossed the link
    hosts.cluster.assert_idle(prefill, decode)


def test_a_prefill_worker_restarted_on_its_address_serves_with_its_new_agent(hosts, llm):
    """Killed mid-transfer, with no other prefill worker: the request fails, and the decode
    worker fences the dead writer's blocks (a NIXL writer cannot confirm: they are quarantined
    until it is known gone). A new process on the same host, port and worker id, with a new
    transfer agent, then serves exactly: nothing of the old agent is used, no block is lost."""
    (doomed,), (decode,) = hosts.live("prefill"), hosts.live("decode")
    killer = WhenTransferring(hosts, lambda prefill: prefill.kill())
    killer.start()
    with pytest.raises(grpc.RpcError) as lost:
        generate(hosts.router, CHUNKED_PROMPT, max_tokens=4)
    killer.join()
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value.details()
    wait_until(lambda: hosts.cluster.entry(doomed) is None, timeout_s=60,
               message="the killed worker's registry entry never expired")  # fmt: skip
    # As a restarted pod: the same address, ports and name, a new process and transfer agent.
    port, metrics_port = (
        urlsplit(f"//{doomed.address}").port,
        urlsplit(doomed.info.metrics_url).port,
    )
    restarted = hosts.cluster.start(
        "prefill", "--port", str(port), "--metrics-port", str(metrics_port), host=doomed.host,
        worker_id=doomed.worker_id,
    )  # fmt: skip
    assert restarted.address == doomed.address
    wait_until(lambda: hosts.router.sees(restarted), timeout_s=60,
               message="the router never took in the restarted worker's entry")  # fmt: skip
    (expected,) = greedy_tokens(llm, [CHUNKED_PROMPT], 4)
    assert token_ids(generate(hosts.router, CHUNKED_PROMPT, max_tokens=4)) == expected
    hosts.cluster.assert_idle(restarted, decode)
