"""A prefill that has finished answers its decode worker at once, even when the prefill
worker has already begun its next step (other requests' chunks): the first token does not
wait for that step, and nothing is left held."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.workers.calls import LONG, generate, token_ids
from tests.workers.faulty_worker import HOLD, HOLD_FILE_ENV

FAULTY = (sys.executable, "-m", "tests.workers.faulty_worker")
GREEDY = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    release = tmp_path_factory.mktemp("hold") / "release"
    os.environ[HOLD_FILE_ENV] = str(release)  # the workers inherit it
    started = Cluster(kv_backend="tcp")
    try:
        started.start("prefill", wait=False, program=FAULTY)  # HOLD prompts: held steps
        started.start("decode", wait=False)
        started.wait_all_registered()
        yield started, release
    finally:
        release.touch()  # no step stays held
        started.stop()
        del os.environ[HOLD_FILE_ENV]


def test_the_first_token_does_not_wait_for_the_prefill_workers_next_step(cluster):
    """A long HOLD prompt (three 512-token chunks) and a short one: once the short one has
    finished its prefill, the long prompt's next step runs alone and is held. The short
    request must complete while that step is still held."""
    started, release = cluster
    prefill, decode = started.workers
    long_prompt, short_prompt = HOLD + LONG[:1200], LONG[2000:2024]
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(generate, decode.address, long_prompt, prefill.address, **GREEDY)
        short = pool.submit(generate, decode.address, short_prompt, prefill.address, **GREEDY)
        wait([short], timeout=120)
        assert short.done(), "the short request waited for the held step"
        assert not held.done() and not release.exists()  # the held step was in progress
        messages = short.result()
        assert len(token_ids(messages)) == 2 and messages[-1].finish_reason == "length"
        release.touch()
        messages = held.result(timeout=300)
        assert len(token_ids(messages)) == 2 and messages[-1].finish_reason == "length"
    started.assert_idle(prefill, decode)
