"""Network faults between separate hosts (Redis, the router, two prefill and two decode hosts,
KV over tcp): a partition mid-transfer, a lossy KV link, the router cut from Redis or from a
decode host mid-stream. Each request still ends with exactly the single-process engine's
tokens, and every worker ends with every KV block free (none quarantined)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from pdserve.netns import faults_unavailable_reason
from tests.cluster import WorkerProcess
from tests.multihost.conftest import (
    Hosts,
    cluster_on_hosts,
    generate,
    greedy_tokens,
    host_of,
    token_ids,
)
from tests.waiting import wait_until
from tests.workers.calls import LONG

pytestmark = pytest.mark.skipif(
    faults_unavailable_reason() is not None, reason=f"{faults_unavailable_reason()}"
)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with cluster_on_hosts("tcp", 2, 2, "--max-migrations", "1") as hosts:
        yield hosts


def assert_all_idle(hosts: Hosts) -> None:
    hosts.cluster.assert_idle(*hosts.live("prefill"), *hosts.live("decode"))


class CutWhenTransferring(threading.Thread):
    """Cuts a prefill host from every decode host once its KV is on the wire: a first chunk
    sent while the prompt's later chunks are still being computed. The cut lasts until
    heal(), which re-raises a failure to see that moment (a late cut proves nothing)."""

    def __init__(self, hosts: Hosts) -> None:
        super().__init__(name="cut-when-transferring")
        self.hosts, self.failure, self.cut_off = hosts, None, None
        self.faults = ExitStack()

    def transferring(self) -> WorkerProcess | None:
        for prefill in self.hosts.live("prefill"):
            sent = prefill.metric("pdserve_kv_transfer_bytes_total", backend="tcp",
                                  direction="sent")  # fmt: skip
            if sent > self.sent_before[prefill.worker_id] and (
                prefill.metric("pdserve_prefill_queued_tokens") > 0
            ):
                return prefill
        return None

    def run(self) -> None:
        try:
            self.cut_off = wait_until(
                self.transferring, timeout_s=120, interval_s=0.02,
                message="no prefill worker seen mid-transfer",
            )  # fmt: skip
            decode_hosts = [host_of(d) for d in self.hosts.live("decode")]
            self.faults.enter_context(self.hosts.network.cut(host_of(self.cut_off), *decode_hosts))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread by heal()
            self.failure = e

    def start(self) -> None:
        self.sent_before = {
            p.worker_id: p.metric("pdserve_kv_transfer_bytes_total", backend="tcp",
                                  direction="sent")
            for p in self.hosts.live("prefill")
        }  # fmt: skip
        super().start()

    def heal(self) -> None:
        self.join()
        self.faults.close()
        if self.failure is not None:
            raise self.failure


def test_a_prefill_host_cut_off_mid_transfer_is_fenced_and_the_request_retried(hosts, llm):
    (expected,) = greedy_tokens(llm, [LONG], MAX_TOKENS)
    attempts = lambda outcome: sum(  # noqa: E731
        d.metric("pdserve_decode_prefill_attempts_total", outcome=outcome)
        for d in hosts.live("decode")
    )
    failed_before = attempts("failed")
    cut = CutWhenTransferring(hosts)
    cut.start()
    try:
        messages = generate(hosts.router, LONG, MAX_TOKENS)
    finally:
        cut.heal()
    assert token_ids(messages) == expected
    assert attempts("failed") == failed_before + 1  # then the other prefill host's attempt
    assert_all_idle(hosts)
