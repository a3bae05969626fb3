"""A closed loop is bounded load: 32 clients that each send their next request when the last
one ends, against `pdserve up` with its default settings, are all served (no 429), however
long the queue makes them wait; the prompts the prefill worker's budget leaves over are
partly computed by the decode worker (`pdserve up`'s prefill overflow)."""

from __future__ import annotations

import asyncio

import httpx
from router_harness import pdserve_up

from pdserve.redis_server import free_port
from tests.cluster import sample_value

NUM_CLIENTS = 32
NUM_ROUNDS = 2
PROMPT = " ".join(f"Item {i} costs {i * 3} coins." for i in range(24))  # ~190 tokens


async def closed_loop(url: str) -> list[int]:
    async def client(i: int) -> list[int]:
        statuses = []
        for round_ in range(NUM_ROUNDS):
            body = {"model": "smollm2-135m", "prompt": f"{i}.{round_} {PROMPT}", "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            response = await http.post(f"{url}/v1/completions", json=body)
            statuses.append(response.status_code)
        return statuses

    async with httpx.AsyncClient(timeout=600) as http:
        per_client = await asyncio.gather(*(client(i) for i in range(NUM_CLIENTS)))
    return [status for statuses in per_client for status in statuses]


def test_32_closed_loop_clients_get_no_429_under_default_settings(tmp_path):
    http_port = free_port()
    with pdserve_up(
        "--http-port", str(http_port), "--grpc-port", str(free_port()), "--no-warmup",
        "--kv-backend", "tcp", "--log-dir", str(tmp_path),
    ):  # fmt: skip
        url = f"http://127.0.0.1:{http_port}"
        statuses = asyncio.run(closed_loop(url))
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert statuses == [200] * (NUM_CLIENTS * NUM_ROUNDS)
    # 32 prompts of ~190 tokens at once are thrice the prefill worker's 2,048-token budget.
    assert sample_value(metrics, "pdserve_router_routed_total", role="decode_prefill",
                        worker="decode-0") > 0  # fmt: skip
